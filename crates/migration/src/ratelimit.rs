//! A token bucket for `max_bandwidth_mbps`: sends wait in proportion to their size, so the
//! rate is smooth at frame granularity rather than bursty per second.

use std::time::{Duration, Instant};

pub struct RateLimiter {
    bytes_per_s: Option<f64>,
    tokens: f64,
    burst: f64,
    last: Instant,
}

impl RateLimiter {
    /// `mbps` = megabits per second; `None` for no limit.
    pub fn new(mbps: Option<u64>) -> Self {
        let bytes_per_s = mbps.map(|m| m as f64 * 1e6 / 8.0);
        // Up to 5 ms of sending may go out at once.
        let burst = bytes_per_s
            .map(|b| (b * 0.005).max(64.0 * 1024.0))
            .unwrap_or(0.0);
        Self {
            bytes_per_s,
            tokens: burst,
            burst,
            last: Instant::now(),
        }
    }

    /// Takes `bytes` of tokens, sleeping until the bucket can pay for them.
    pub fn take(&mut self, bytes: u64) {
        let Some(rate) = self.bytes_per_s else { return };
        let now = Instant::now();
        self.tokens =
            (self.tokens + now.duration_since(self.last).as_secs_f64() * rate).min(self.burst);
        self.last = now;
        self.tokens -= bytes as f64;
        if self.tokens < 0.0 {
            std::thread::sleep(Duration::from_secs_f64(-self.tokens / rate));
        }
    }

    /// Frames small enough that one frame is about one burst.
    pub fn batch_pages(&self, default: usize) -> usize {
        match self.bytes_per_s {
            Some(_) => ((self.burst / 4096.0) as usize).clamp(16, default),
            None => default,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limited_pays_for_what_it_sends() {
        // 80 Mbit/s = 10 MB/s: 2 MB beyond the burst takes at least ~0.2 s.
        let mut r = RateLimiter::new(Some(80));
        let t = Instant::now();
        for _ in 0..20 {
            r.take(100_000);
        }
        assert!(
            t.elapsed() >= Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
    }
}
