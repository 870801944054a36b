//! The background registrar: resident shards registered with the device one at a time, paced
//! (`pool.page_cache_register = "auto"`), so registration never runs on an epoch's hot path.

use super::*;

impl PageCache {
    /// Starts the background registrar if it is not running.
    pub(super) fn start_registrar(&self) {
        let mut r = self.registrar.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_some() {
            return;
        }
        let shared = self.shared.clone();
        let rest = std::env::var("UBDIRECT_REGISTER_REST")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|f| f.is_finite() && *f >= 0.0)
            .unwrap_or(REST_FACTOR);
        match std::thread::Builder::new()
            .name("ubdirect-register".into())
            .spawn(move || shared.register_in_background(rest))
        {
            Ok(t) => *r = Some(t),
            Err(e) => ubdirect_ub::fallback::record(
                "page_cache_registrar",
                format!("the background registrar did not start ({e}): warm reads stay copies"),
            ),
        }
    }
}

impl Shared {
    /// Maps and registers shard `i` if it is a candidate, not mapped, not refused and resident;
    /// publishes it to the chunks that start next.
    pub(super) fn register(&self, i: usize, background: bool) -> bool {
        let Some(Some(c)) = self.shards.get(i) else {
            return false;
        };
        if c.mapped.lock().unwrap_or_else(|p| p.into_inner()).is_some()
            || c.refused.load(Ordering::Relaxed)
        {
            return false;
        }
        let st = c.state(&self.budget);
        if !st.resident {
            return false;
        }
        // Its staged mapping, still right (`kept`), is mapped again to be registered: the chunk
        // files' memory regions twice over. Where the bound has no room for that, the staged
        // mapping is let go first (its reads go through the cache meanwhile); the regions come
        // back once the chunks copying out of it are done, and a later pass registers it.
        if let (None, Some(kept)) = (&st.chunks, &st.kept)
            && !self.budget.regions_fit(kept.file().files().count() as u64)
        {
            drop(st);
            lock(&c.staged).take();
            self.unpublish_staged(i);
            return false;
        }
        let done = self.map_and_publish(i, Some(self.device.as_ref()), st.chunks);
        if done && background {
            self.background.fetch_add(1, Ordering::Relaxed);
        }
        done
    }

    /// The registrar's loop: passes over the shards, registering the resident ones one at a time
    /// and resting `rest` × the time each took, until every candidate is mapped or refused.
    pub(super) fn register_in_background(&self, rest: f64) {
        loop {
            let mut left = false;
            for i in 0..self.shards.len() {
                if self.stop.load(Ordering::Relaxed) {
                    return;
                }
                let Some(Some(c)) = self.shards.get(i) else {
                    continue;
                };
                let t = std::time::Instant::now();
                if self.register(i, true) {
                    let pause = t.elapsed().mul_f64(rest);
                    sleep_unless_stopped(&self.stop, pause);
                } else if c.mapped.lock().is_ok_and(|m| m.is_none())
                    && !c.refused.load(Ordering::Relaxed)
                {
                    left = true; // not resident yet: filled this epoch, registered later
                }
            }
            if !left {
                return;
            }
            sleep_unless_stopped(&self.stop, Duration::from_millis(100));
        }
    }
}

pub(super) fn sleep_unless_stopped(stop: &AtomicBool, d: Duration) {
    let until = std::time::Instant::now() + d;
    while !stop.load(Ordering::Relaxed) {
        let now = std::time::Instant::now();
        if now >= until {
            return;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(20)));
    }
}
