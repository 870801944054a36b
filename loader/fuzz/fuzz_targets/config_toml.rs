#![no_main]
//! Run configs in TOML: parse and validate, or a typed error; what validates plans.

use libfuzzer_sys::fuzz_target;
use ubdirect_loader::RunConfig;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(cfg) = RunConfig::from_toml(text, "fuzz")
    {
        let _ = cfg.plan_config().validate();
        let _ = cfg.engine_config();
    }
});
