//! Issue 23: limits that hold across addresses (the scenario:
//! `ubdirect_testkit::attack::token_limits`). Attackers on five loopback addresses, all presenting
//! one read-only token, try to take every staging block and connection; legitimate clients of
//! another token read.
//!
//! Asserted here, as behaviour: the attack meets the limits (refusals, write deadlines), every
//! legitimate request is served (no error, none past its 10 s deadline), the other token moves bytes
//! in every attacked window (without the per-token limits it got none in some), and the server is
//! back to the legitimate clients' connections and its RSS within 20 s. The throughput kept is
//! `ubdirect-bench remote`'s `token limits` row (attacked ÷ control, median of interleaved rounds).
//!
//! `UBDIRECT_ADVERSARIAL_SECS` sets the windows' total (default 6 s: 2 rounds of three 1 s windows,
//! each attacked window long enough for the server's 0.5 s write deadline to act; longer by hand).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use ubdirect_testkit::attack::token_limits;

#[test]
fn attackers_sharing_a_token_on_many_addresses_cannot_starve_another_token() {
    let secs = ubdirect_testkit::soak_secs("UBDIRECT_ADVERSARIAL_SECS", 6.0);
    let o = token_limits::run(&ubdirect_testkit::tmp!("net-token-limits"), secs);
    eprintln!(
        "token limits: attacked ÷ control {:.2} (median of {} rounds; a figure, not asserted)",
        o.rates.attacked_over_control(),
        o.rates.rounds.len()
    );
    assert!(
        o.failures.is_empty(),
        "legitimate requests failed: {:?}",
        o.failures
    );
    assert!(o.limits_reached, "the attack did not reach the limits");
    assert!(
        o.rates.min_attacked() > 0.0,
        "the attackers' token starved the other in an attacked window: {:?}",
        o.rates
    );
    let after = o.recovered.unwrap();
    eprintln!("after: {after}");
}
