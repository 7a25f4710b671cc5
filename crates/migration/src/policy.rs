//! When to stop iterating and switch over: a pure function of measured figures.

use crate::PAGE_SIZE;
use crate::params::AutoConverge;

/// Bytes a page costs on the wire when sent in full (data + descriptor).
pub const FULL_PAGE_WIRE_BYTES: f64 = (PAGE_SIZE + 8) as f64;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// Rounds completed so far (round 0 included).
    pub rounds_done: u32,
    /// Dirty pages waiting to be sent.
    pub pages_remaining: u64,
    /// How fast pages move, in full-page bytes per second (see `Session::measure`).
    pub bandwidth_bytes_per_s: f64,
    pub dirty_pages_per_s: f64,
    /// Consecutive recent rounds whose dirty set did not shrink by a tenth.
    pub stalled_rounds: u32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    pub max_downtime_ms: f64,
    pub max_rounds: u32,
    /// Give up iterating after this many rounds without progress: more rounds only resend
    /// the same pages (the seed papers' "writable working set" floor).
    pub max_stalled_rounds: u32,
}

/// A dirty set at least this share of the one before is no progress.
const NO_PROGRESS: f64 = 0.9;

/// Whether a dirty set of `now` pages is progress over the previous one of `before`.
pub fn shrank(before: u64, now: u64) -> bool {
    (now as f64) < before as f64 * NO_PROGRESS
}

#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Send another live round.
    Iterate,
    /// Pause and send the rest; `converged` false means the downtime goal will be missed.
    SwitchOver { converged: bool, why: String },
}

/// Time to send `pages` at the measured bandwidth, in ms.
pub fn expected_downtime_ms(pages: u64, bandwidth_bytes_per_s: f64) -> f64 {
    if bandwidth_bytes_per_s <= 0.0 {
        return f64::INFINITY;
    }
    pages as f64 * FULL_PAGE_WIRE_BYTES / bandwidth_bytes_per_s * 1e3
}

/// Whether the guest dirties at least `share` of what the link sends, in full-page bytes.
fn dirties_at_least(m: &Measured, share: f64) -> bool {
    m.dirty_pages_per_s * FULL_PAGE_WIRE_BYTES >= share * m.bandwidth_bytes_per_s
}

/// True when the guest dirties memory faster than the link drains it.
pub fn outpaced(m: &Measured) -> bool {
    dirties_at_least(m, 1.0)
}

/// True when the guest dirties at least nine tenths of what the link sends: the next round's
/// set cannot shrink by the tenth that `shrank` calls progress. A guest that rewrites its
/// whole set every round measures at about the link's rate (the distinct pages a round left
/// dirty ÷ its time), so this, unlike `outpaced`, sees it from the first round.
pub fn will_stall(m: &Measured) -> bool {
    dirties_at_least(m, NO_PROGRESS)
}

/// Whether pre-copy cannot converge, judged from one round: the next round cannot shrink
/// the dirty set (`will_stall`, or a round already did not) and what is left does not fit the
/// downtime budget, so every further round would resend about as much as it sends. A guest
/// that rewrites its whole set measures at the link's rate, never clearly above it, so
/// `outpaced` alone would leave it to chance. With `--auto-postcopy` the source then switches
/// to post-copy at once instead of waiting for rounds to stall.
pub fn cannot_converge(m: &Measured, limits: &Limits) -> bool {
    (will_stall(m) || m.stalled_rounds > 0)
        && expected_downtime_ms(m.pages_remaining, m.bandwidth_bytes_per_s) > limits.max_downtime_ms
}

/// Auto-converge's trigger (QEMU's throttle-trigger-threshold): the guest dirtied at least
/// half of what the link sent in the same time. Pre-copy only shrinks its dirty set when the
/// link moves clearly more than the guest dirties; a slower guest is the way there.
pub fn should_throttle(m: &Measured) -> bool {
    dirties_at_least(m, THROTTLE_TRIGGER)
}

const THROTTLE_TRIGGER: f64 = 0.5;

/// Auto-converge's throttle, in percent of each vCPU's time: at first 20 %, then 10 % more a
/// step (QEMU's cpu-throttle defaults), at most 99 %.
const THROTTLE_FIRST: u8 = 20;
const THROTTLE_STEP: u8 = 10;
const THROTTLE_MOST: u8 = 99;
/// What a throttled guest may dirty, as a share of what the link sends: each round then sends
/// at most half the pages of the one before.
const THROTTLE_TARGET: f64 = 0.5;

/// The throttle after `current`: QEMU's step, or more where the measured rates say so. Slowed
/// by `current`, the guest dirtied `dirty_pages_per_s`, so unthrottled it dirties that ÷ its
/// share of the CPU; the throttle that brings this to `THROTTLE_TARGET` of the link is
/// reached in fewer steps than one round per 10 % (a round over a slow link can take
/// seconds), but a step at most halves the guest's share, so one noisy round cannot send it
/// to 99 %. The rate counts distinct pages per round, a lower bound when the guest rewrote its
/// whole set: the next round measures again.
pub fn next_throttle(current: u8, m: &Measured) -> u8 {
    let stepped = match current {
        0 => THROTTLE_FIRST,
        t => t.saturating_add(THROTTLE_STEP),
    };
    let halved = current.saturating_add(100u8.saturating_sub(current) / 2);
    let share = (1.0 - f64::from(current.min(THROTTLE_MOST)) / 100.0).max(0.01);
    let unthrottled = m.dirty_pages_per_s / share;
    let link = m.bandwidth_bytes_per_s / FULL_PAGE_WIRE_BYTES;
    let needed = if unthrottled > 0.0 {
        (100.0 * (1.0 - THROTTLE_TARGET * link / unthrottled)).ceil()
    } else {
        0.0
    };
    let needed = (needed.clamp(0.0, 100.0) as u8).min(halved);
    stepped.max(needed).min(THROTTLE_MOST)
}

/// Whether auto-converge, set to `when`, slows the guest (harder) before the next round:
/// `Early` at QEMU's trigger; `WhenStalled` only once pre-copy shows it cannot get there on its
/// own (a round without progress, or rates that make the next one so) while the rest does not
/// fit the budget, the point from which the rounds would only count down to a stop-and-copy
/// over budget.
pub fn throttle_now(when: AutoConverge, m: &Measured, limits: &Limits) -> bool {
    match when {
        AutoConverge::Off => false,
        AutoConverge::Early => should_throttle(m),
        AutoConverge::WhenStalled => {
            (will_stall(m) || m.stalled_rounds > 0)
                && expected_downtime_ms(m.pages_remaining, m.bandwidth_bytes_per_s)
                    > limits.max_downtime_ms
        }
    }
}

/// A final set this small (1 MiB) moves in well under a millisecond on any link worth
/// migrating over: not worth another round.
pub const SMALL_FINAL_PAGES: u64 = 256;

pub fn decide(m: &Measured, limits: &Limits) -> Decision {
    let downtime = expected_downtime_ms(m.pages_remaining, m.bandwidth_bytes_per_s);
    // Within budget, one more round is still worth it while the dirty set keeps shrinking:
    // the budget is a ceiling, and downtime is what the guest loses.
    let still_shrinking = m.stalled_rounds == 0 && m.pages_remaining > SMALL_FINAL_PAGES;
    if downtime <= limits.max_downtime_ms
        && (!still_shrinking || m.rounds_done >= limits.max_rounds)
    {
        return Decision::SwitchOver {
            converged: true,
            why: format!(
                "{} pages left: expected downtime {downtime:.1} ms within {} ms",
                m.pages_remaining, limits.max_downtime_ms
            ),
        };
    }
    let pace = if outpaced(m) {
        " (the guest dirties memory faster than the link sends it)"
    } else {
        ""
    };
    let give_up = |reason: String| Decision::SwitchOver {
        converged: false,
        why: format!(
            "{reason}{pace}: stop-and-copy of {} pages, expected downtime {downtime:.1} ms",
            m.pages_remaining
        ),
    };
    if m.rounds_done >= limits.max_rounds {
        return give_up(format!("did not converge in {} rounds", m.rounds_done));
    }
    if m.stalled_rounds >= limits.max_stalled_rounds {
        return give_up(format!(
            "not converging: the dirty set stopped shrinking for {} rounds",
            m.stalled_rounds
        ));
    }
    Decision::Iterate
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_downtime_ms: 10.0,
        max_rounds: 5,
        max_stalled_rounds: 3,
    };

    fn m(rounds_done: u32, pages_remaining: u64, dirty: f64) -> Measured {
        Measured {
            rounds_done,
            pages_remaining,
            bandwidth_bytes_per_s: 100e6,
            dirty_pages_per_s: dirty,
            stalled_rounds: 0,
        }
    }

    #[test]
    fn stops_iterating_when_the_dirty_set_stops_shrinking() {
        let stalled = Measured {
            stalled_rounds: 3,
            ..m(3, 100_000, 50_000.0)
        };
        match decide(&stalled, &LIMITS) {
            Decision::SwitchOver { converged, why } => {
                assert!(!converged);
                assert!(why.contains("stopped shrinking"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        assert!(shrank(1000, 899) && !shrank(1000, 950));
    }

    #[test]
    fn switches_when_the_rest_fits_the_downtime() {
        // 200 pages ≈ 0.82 MB ≈ 8.2 ms at 100 MB/s
        assert!(matches!(
            decide(&m(1, 200, 0.0), &LIMITS),
            Decision::SwitchOver {
                converged: true,
                ..
            }
        ));
        assert_eq!(decide(&m(1, 300, 0.0), &LIMITS), Decision::Iterate);
    }

    #[test]
    fn keeps_shrinking_the_final_set_while_it_shrinks() {
        let fits_but_shrinking = Measured {
            bandwidth_bytes_per_s: 1e9, // 2,000 pages ≈ 8.2 ms
            ..m(2, 2_000, 0.0)
        };
        assert_eq!(decide(&fits_but_shrinking, &LIMITS), Decision::Iterate);
        let stopped_shrinking = Measured {
            stalled_rounds: 1,
            ..fits_but_shrinking
        };
        assert!(matches!(
            decide(&stopped_shrinking, &LIMITS),
            Decision::SwitchOver {
                converged: true,
                ..
            }
        ));
    }

    #[test]
    fn gives_up_after_max_rounds_and_says_why() {
        match decide(&m(5, 100_000, 50_000.0), &LIMITS) {
            Decision::SwitchOver { converged, why } => {
                assert!(!converged);
                assert!(why.contains("faster than the link"), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_guest_that_outpaces_the_link_cannot_converge() {
        // 100 MB/s link; 30,000 dirty pages/s × 4 KiB ≈ 123 MB/s: outpaced, and 20,000 pages
        // take ~820 ms against a 10 ms budget.
        let mut x = m(1, 20_000, 30_000.0);
        assert!(cannot_converge(&x, &LIMITS));
        // A whole set rewritten each round measures at the link's rate, a hair either side:
        // 24,000 pages/s ≈ 98 MB/s.
        x.dirty_pages_per_s = 24_000.0;
        assert!(cannot_converge(&x, &LIMITS));
        // Clearly slower than the link: more rounds help.
        x.dirty_pages_per_s = 10_000.0;
        assert!(!cannot_converge(&x, &LIMITS));
        // Outpaced but already within budget: the switch is what decide() says anyway.
        let small = m(1, 100, 30_000.0);
        assert!(!cannot_converge(&small, &LIMITS));
    }

    #[test]
    fn throttling_starts_at_half_the_link() {
        // 100 MB/s link: 12,000 dirty pages/s × 4 KiB ≈ 49 MB/s is below half; 13,000 above.
        assert!(!should_throttle(&m(2, 5_000, 12_000.0)));
        assert!(should_throttle(&m(2, 5_000, 13_000.0)));
    }

    #[test]
    fn when_stalled_throttles_only_what_cannot_converge_on_its_own() {
        let when = AutoConverge::WhenStalled;
        // Dirtying 49 MB/s of a 100 MB/s link while the set shrinks: left alone. (Early
        // throttles from half the link: 13,000 pages/s, 53 MB/s.)
        let shrinking = m(2, 50_000, 12_000.0);
        assert!(!throttle_now(when, &shrinking, &LIMITS));
        assert!(throttle_now(
            AutoConverge::Early,
            &m(2, 50_000, 13_000.0),
            &LIMITS
        ));
        // The same guest once a round made no progress: throttled.
        let stalled = Measured {
            stalled_rounds: 1,
            ..shrinking
        };
        assert!(throttle_now(when, &stalled, &LIMITS));
        // Outpacing the link, or nearly (a guest that rewrites its whole set every round
        // measures at about the link's rate): throttled from the first round that shows it.
        assert!(throttle_now(when, &m(1, 50_000, 30_000.0), &LIMITS));
        assert!(throttle_now(when, &m(1, 50_000, 23_000.0), &LIMITS));
        assert!(!throttle_now(when, &m(1, 50_000, 21_000.0), &LIMITS));
        // Stalled but within budget: the switch comes next, no throttle needed.
        let fits = Measured {
            stalled_rounds: 2,
            ..m(3, 100, 30_000.0)
        };
        assert!(!throttle_now(when, &fits, &LIMITS));
        assert!(!throttle_now(AutoConverge::Off, &stalled, &LIMITS));
    }

    #[test]
    fn the_throttle_steps_or_jumps_to_what_the_rates_need() {
        // 100 MB/s ≈ 24,366 pages/s. A guest dirtying 12,000 pages/s needs no more than
        // QEMU's steps: 20, 30, ...
        let mild = m(2, 50_000, 12_000.0);
        assert_eq!(next_throttle(0, &mild), 20);
        assert_eq!(next_throttle(20, &mild), 30);
        // Dirtying 48,732 pages/s (twice the link) unthrottled: down to half the link's
        // rate takes 75 %; a step halves the guest's share at most: 50 %, then 75 %.
        let fast = m(1, 50_000, 48_732.0);
        assert_eq!(next_throttle(0, &fast), 50);
        let at_half = m(2, 50_000, 48_732.0 * 0.5);
        assert_eq!(next_throttle(50, &at_half), 75);
        // The same guest measured at 20 % dirtied 0.8 × as much: the same estimate, and the
        // step from 20 % reaches 60 % at most.
        let slowed = m(2, 50_000, 48_732.0 * 0.8);
        assert_eq!(next_throttle(20, &slowed), 60);
        // A wild rate (one noisy round) still only halves the share; never above 99 %, and
        // still a step at 95 %.
        assert_eq!(next_throttle(0, &m(1, 50_000, 1e9)), 50);
        assert_eq!(next_throttle(60, &m(1, 50_000, 1e9)), 80);
        assert_eq!(next_throttle(95, &mild), 99);
        assert_eq!(next_throttle(99, &fast), 99);
    }

    #[test]
    fn no_bandwidth_means_infinite_downtime() {
        assert!(expected_downtime_ms(1, 0.0).is_infinite());
        assert_eq!(expected_downtime_ms(0, 1.0), 0.0);
    }
}
