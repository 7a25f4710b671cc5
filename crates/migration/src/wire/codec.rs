//! Compression of page data, one frame (batch of pages) at a time, and `auto`: the choice of
//! the codec that moves a batch soonest over this link with the cores this sender may use.
//!
//! Codecs come from the field: `lz4_flex` (pure Rust LZ4 block format) and `zstd` (the
//! reference library). Only the choice is ours: no library picks a codec by link and data.

use std::time::Duration;

use crate::error::{Error, Result};

/// zstd's level: 1 is its fastest; higher levels cost several times the CPU for a few percent
/// on memory pages.
const ZSTD_LEVEL: i32 = 1;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Codec {
    #[default]
    None,
    Lz4,
    Zstd,
}

impl Codec {
    pub const ALL: [Codec; 3] = [Codec::None, Codec::Lz4, Codec::Zstd];

    /// The codec's bits in a page frame's flags (bits 1–2).
    pub fn flag_bits(self) -> u8 {
        match self {
            Codec::None => 0,
            Codec::Lz4 => 1 << 1,
            Codec::Zstd => 2 << 1,
        }
    }

    pub fn from_flags(flags: u8) -> Result<Self> {
        match (flags >> 1) & 3 {
            0 => Ok(Codec::None),
            1 => Ok(Codec::Lz4),
            2 => Ok(Codec::Zstd),
            other => Err(Error::Protocol(format!(
                "page frame compressed with unknown codec {other}"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Compresses `input` into `out` (replacing what it held).
    pub fn compress(self, input: &[u8], out: &mut Vec<u8>, ctx: &mut Contexts) -> Result<()> {
        out.clear();
        match self {
            Codec::None => out.extend_from_slice(input),
            Codec::Lz4 => {
                out.resize(lz4_flex::block::get_maximum_output_size(input.len()), 0);
                let n = lz4_flex::block::compress_into(input, out)
                    .map_err(|e| Error::State(format!("lz4: {e}")))?;
                out.truncate(n);
            }
            Codec::Zstd => {
                out.reserve(zstd::zstd_safe::compress_bound(input.len()));
                let zstd_err = |e: std::io::Error| Error::State(format!("zstd: {e}"));
                if ctx.zstd.is_none() {
                    ctx.zstd = Some(zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(zstd_err)?);
                }
                let c = ctx.zstd.as_mut().expect("made above");
                c.compress_to_buffer(input, out).map_err(zstd_err)?;
            }
        }
        Ok(())
    }

    /// Decompresses `input` into `out`; returns the length, which must be at least `least`
    /// (and fits `out`): anything else is a corrupt or hostile frame.
    pub fn decompress(self, input: &[u8], out: &mut [u8], least: usize) -> Result<usize> {
        let bad = |e: String| Error::Protocol(format!("{} page data: {e}", self.name()));
        let n = match self {
            Codec::None => {
                if input.len() > out.len() {
                    return Err(bad("length mismatch".into()));
                }
                out[..input.len()].copy_from_slice(input);
                input.len()
            }
            Codec::Lz4 => {
                lz4_flex::block::decompress_into(input, out).map_err(|e| bad(e.to_string()))?
            }
            Codec::Zstd => {
                zstd::bulk::decompress_to_buffer(input, out).map_err(|e| bad(e.to_string()))?
            }
        };
        if n < least {
            return Err(bad(format!(
                "{n} bytes where the descriptors promise at least {least}"
            )));
        }
        Ok(n)
    }
}

/// A sender's compression contexts, kept from batch to batch (a zstd context is costly to
/// make).
#[derive(Default)]
pub struct Contexts {
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

/// What `--compression` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    #[default]
    None,
    Fixed(Codec),
    Auto,
}

impl std::str::FromStr for Compression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Compression::None),
            "lz4" => Ok(Compression::Fixed(Codec::Lz4)),
            "zstd" => Ok(Compression::Fixed(Codec::Zstd)),
            "auto" => Ok(Compression::Auto),
            other => Err(Error::Param(format!(
                "unknown compression '{other}' (use none, lz4, zstd or auto)"
            ))),
        }
    }
}

impl Compression {
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Fixed(c) => c.name(),
            Compression::Auto => "auto",
        }
    }
}

/// One batch's outcome, as `Chooser` learns from it.
#[derive(Clone, Copy, Debug)]
pub struct BatchCost {
    pub codec: Codec,
    pub raw_bytes: usize,
    pub packed_bytes: usize,
    pub compress_time: Duration,
    /// Time the write (and the rate limiter) held the sender: how fast the link drains.
    pub write_time: Duration,
}

/// Learns, per sender, each codec's speed per core and ratio on this data, and the link's rate,
/// and picks the codec with the smallest expected time per batch:
/// `max(raw / (speed · cores), raw · ratio / link)` (no codec: `raw / link`): the socket
/// buffer lets the link send one batch while the next ones are compressed, so the slower of
/// the two sets the pace; `cores` threads compress side by side (`--migration-threads`).
/// A codec not picked is tried again now and then, so a change in the data or the link is
/// seen: every `PROBE_EVERY` batches while it is close or barely measured, and each time a try
/// confirms it clearly loses, twice as long (at most `PROBE_MOST`): on a link faster than every codec a try costs
/// several batches' time, and at a fixed pace the tries alone made `auto` a fifth slower than
/// plain.
#[derive(Clone, Debug, Default)]
pub struct Chooser {
    /// Per codec: input bytes per second while compressing, on one core (EWMA).
    speed: [Option<f64>; 3],
    /// Per codec: packed ÷ raw (EWMA).
    ratio: [Option<f64>; 3],
    /// Bytes per second the link took: EWMA of what the send queue drained while it stayed
    /// busy (`learn_link`), or, without such samples, of bytes written ÷ time the write held
    /// the sender (which a large socket buffer hides at first).
    link: Option<f64>,
    drained_samples: bool,
    /// Whether each codec has been picked yet, and the batch it was last picked for.
    tried: [bool; 3],
    last_used: [u64; 3],
    /// Per codec: batches between its tries while it is not the pick (0: `PROBE_EVERY`), and
    /// the pick its wait was last doubled for (each try doubles it once, however many of the
    /// codec's batches are learned from late).
    probe_every: [u64; 3],
    put_off_for: [u64; 3],
    /// Per codec: batches learned from (its first few estimates are noisy: it is put off only
    /// once it has `SETTLED` of them).
    samples: [u32; 3],
    /// The link's rate when the first try was put off since every codec was last made due: a
    /// rate that has moved by `LINK_NEWS` since is news for every codec.
    link_when_put_off: Option<f64>,
    batches: u64,
    /// Threads compressing this sender's batches side by side (0 or 1: the sender itself).
    cores: usize,
}

/// Each of the two codecs not picked is tried every this many batches while close (the pace
/// of one try every 16th batch, in turn, that `auto` had before it put clear losers off).
const PROBE_EVERY: u64 = 32;
const PROBE_MOST: u64 = 256;
const SETTLED: u32 = 4;
/// A codec whose expected time is within this factor of the pick's is a close contender: it
/// keeps being tried every `PROBE_EVERY` batches.
const CONTENDER: f64 = 1.2;
/// A link rate that moved by this factor since the tries were put off is news: every codec is
/// tried again soon. (A frame's ratio or speed is not: pages of mixed content and a shared CPU
/// make those swing from frame to frame, and the next try still comes within `PROBE_MOST`.)
const LINK_NEWS: f64 = 2.0;
/// Weight of the newest sample in every average.
const EWMA_NEW: f64 = 0.25;

fn ewma(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |o| o + EWMA_NEW * (new - o)))
}

impl Chooser {
    /// A chooser for a sender whose batches `cores` threads compress side by side: a codec's
    /// speed per core counts that many times.
    pub fn on_cores(mut self, cores: usize) -> Self {
        self.cores = cores;
        self
    }

    /// The codec for the next batch.
    pub fn pick(&mut self) -> Codec {
        self.batches += 1;
        // Measure every codec once first, then keep each estimate fresh. A pick counts as a
        // use at once: with packer threads it is learned from only batches later.
        let c = if let Some(&c) = Codec::ALL.iter().find(|c| !self.tried[c.index()]) {
            c
        } else {
            if let (Some(then), Some(now)) = (self.link_when_put_off, self.link)
                && (now > LINK_NEWS * then || now < then / LINK_NEWS)
            {
                self.probe_every = [0; 3];
                self.link_when_put_off = None;
            }
            let best = self.best();
            let overdue = |c: &&Codec| {
                let i = c.index();
                let every = self.probe_every[i].max(PROBE_EVERY);
                (self.batches - self.last_used[i]).checked_sub(every)
            };
            Codec::ALL
                .iter()
                .filter(|c| **c != best)
                .filter_map(|c| overdue(&c).map(|late| (late, *c)))
                .max_by_key(|(late, _)| *late)
                .map_or(best, |(_, c)| c)
        };
        self.tried[c.index()] = true;
        self.last_used[c.index()] = self.batches;
        c
    }

    /// Expected time per raw byte with codec `c`.
    fn cost(&self, c: Codec) -> f64 {
        self.cost_at(c, self.ratio[c.index()], self.speed[c.index()])
    }

    /// Expected time per raw byte with codec `c` at `ratio` and `speed` (per core).
    fn cost_at(&self, c: Codec, ratio: Option<f64>, speed: Option<f64>) -> f64 {
        let link = self.link.unwrap_or(f64::INFINITY).max(1.0);
        let compress = match (c, speed) {
            (Codec::None, _) => 0.0,
            (_, Some(s)) if s > 0.0 => 1.0 / (s * self.cores.max(1) as f64),
            _ => f64::INFINITY,
        };
        f64::max(compress, ratio.unwrap_or(1.0) / link)
    }

    /// The codec with the smallest expected time per raw byte (the first of equals: plain).
    pub fn best(&self) -> Codec {
        *Codec::ALL
            .iter()
            .min_by(|a, b| self.cost(**a).total_cmp(&self.cost(**b)))
            .expect("three codecs")
    }

    pub fn learn(&mut self, b: BatchCost) {
        if b.raw_bytes == 0 {
            return;
        }
        let i = b.codec.index();
        self.samples[i] = self.samples[i].saturating_add(1);
        let ratio = b.packed_bytes as f64 / b.raw_bytes as f64;
        let speed = b.raw_bytes as f64 / b.compress_time.as_secs_f64().max(1e-7);
        self.ratio[i] = ewma(self.ratio[i], ratio);
        if b.codec != Codec::None {
            self.speed[i] = ewma(self.speed[i], speed);
        }
        // A try that confirms a clear loser (by its average, and by this batch alone: the
        // average lags when the pages change) puts its next one off; a close contender keeps
        // its pace.
        let best = self.best();
        let beaten = |cost: f64| cost > CONTENDER * self.cost(best);
        let loses = b.codec != best
            && self.samples[i] >= SETTLED
            && beaten(self.cost(b.codec))
            && beaten(self.cost_at(b.codec, Some(ratio), Some(speed)));
        if !loses {
            self.probe_every[i] = PROBE_EVERY;
        } else if self.put_off_for[i] != self.last_used[i] {
            self.put_off_for[i] = self.last_used[i];
            self.link_when_put_off = self.link_when_put_off.or(self.link);
            self.probe_every[i] = (self.probe_every[i].max(PROBE_EVERY) * 2).min(PROBE_MOST);
        }
        if !self.drained_samples {
            let w = b.write_time.as_secs_f64().max(1e-7);
            self.link = ewma(self.link, b.packed_bytes as f64 / w);
        }
    }

    /// A measured drain rate of the link (bytes/s), taken while data waited in the send queue.
    pub fn learn_link(&mut self, bytes_per_s: f64) {
        if !self.drained_samples {
            self.drained_samples = true;
            self.link = None;
        }
        self.link = ewma(self.link, bytes_per_s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_like(len: usize) -> Vec<u8> {
        let words = [
            "migration ",
            "page ",
            "the ",
            "guest ",
            "memory ",
            "dirty ",
            "round ",
        ];
        let mut v = Vec::with_capacity(len);
        let mut i = 0usize;
        while v.len() < len {
            v.extend_from_slice(words[(i * 7 + i / 3) % words.len()].as_bytes());
            i += 1;
        }
        v.truncate(len);
        v
    }

    #[test]
    fn every_codec_round_trips_and_compresses_text() {
        let input = text_like(64 * 4096);
        for c in Codec::ALL {
            let mut packed = Vec::new();
            c.compress(&input, &mut packed, &mut Contexts::default())
                .unwrap();
            if c != Codec::None {
                assert!(packed.len() * 3 < input.len(), "{c:?}: {}", packed.len());
            }
            let mut out = vec![0u8; input.len()];
            let n = c.decompress(&packed, &mut out, input.len()).unwrap();
            assert_eq!(n, input.len());
            assert!(out == input, "{c:?}");
            assert_eq!(Codec::from_flags(c.flag_bits()).unwrap(), c);
        }
    }

    #[test]
    fn corrupt_or_short_data_is_refused() {
        let input = text_like(8 * 4096);
        for c in [Codec::Lz4, Codec::Zstd] {
            let mut packed = Vec::new();
            c.compress(&input, &mut packed, &mut Contexts::default())
                .unwrap();
            // Promise one page more than the data holds.
            let mut out = vec![0u8; input.len() + 4096];
            let e = c
                .decompress(&packed, &mut out, input.len() + 4096)
                .unwrap_err();
            assert!(e.to_string().contains(c.name()), "{e}");
            // Garbage.
            let garbage = vec![0xffu8; 300];
            let mut out = vec![0u8; input.len()];
            assert!(c.decompress(&garbage, &mut out, 1).is_err(), "{c:?}");
            // Cut short.
            let half = &packed[..packed.len() / 2];
            let whole = out.len();
            assert!(c.decompress(half, &mut out, whole).is_err());
        }
        assert!(Codec::from_flags(3 << 1).is_err());
    }

    fn cost(codec: Codec, ratio: f64, speed_mb: f64, link_mb: f64) -> BatchCost {
        let raw = 4 << 20;
        let packed = (raw as f64 * ratio) as usize;
        BatchCost {
            codec,
            raw_bytes: raw,
            packed_bytes: packed,
            compress_time: if codec == Codec::None {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(raw as f64 / (speed_mb * 1e6))
            },
            write_time: Duration::from_secs_f64(packed as f64 / (link_mb * 1e6)),
        }
    }

    #[test]
    fn auto_compresses_on_a_slow_link_and_not_on_a_fast_one() {
        // A 1 Gbit link (125 MB/s), text-like data: per MB, zstd (ratio 0.3 at 400 MB/s)
        // paces at max(2.5, 2.4) ms, lz4 (0.45 at 900 MB/s) at max(1.1, 3.6), raw at 8 ms.
        let text = [(0.45, 900.0), (0.3, 400.0)];
        assert_eq!(trained(125.0, text).best(), Codec::Zstd);
        // A link faster than either codec: sending raw wins.
        assert_eq!(trained(5000.0, text).best(), Codec::None);
        // Incompressible data on the slow link: compression only costs time.
        assert_eq!(
            trained(125.0, [(1.0, 2000.0), (1.0, 800.0)]).best(),
            Codec::None
        );
        // The send queue's drain rate overrides write times (which a socket buffer makes
        // look like an infinitely fast link).
        let mut buffered = trained(5000.0, text);
        buffered.learn_link(125e6);
        assert_eq!(buffered.best(), Codec::Zstd);
    }

    /// With packer threads a batch is learned from only batches after it was picked: the
    /// warm-up still tries each codec once, and a probe does not repeat the codec it just
    /// tried while that one is in the works.
    #[test]
    fn auto_learning_late_still_tries_each_codec_once() {
        let mut c = Chooser::default().on_cores(4);
        let first: std::collections::HashSet<Codec> = (0..3).map(|_| c.pick()).collect();
        assert_eq!(first.len(), 3, "each codec once before any is learned");
        let probes: Vec<Codec> = (3..PROBE_EVERY * 3)
            .map(|_| c.pick())
            .filter(|p| *p != Codec::None)
            .collect();
        assert_eq!(probes.len(), 4, "{probes:?}");
        assert!(
            probes.windows(2).all(|w| w[0] != w[1]),
            "unlearned probes go round the codecs: {probes:?}"
        );
    }

    /// Runs `n` batches through `c` with every codec costing what `cost_of` says; returns the
    /// picks.
    fn run(c: &mut Chooser, n: usize, cost_of: impl Fn(Codec) -> BatchCost) -> Vec<Codec> {
        (0..n)
            .map(|_| {
                let p = c.pick();
                c.learn(cost_of(p));
                p
            })
            .collect()
    }

    /// Incompressible pages, compressed more slowly than a 1 Gbit link sends them: both
    /// codecs clearly lose on any link of that speed or faster.
    fn random(p: Codec, link_mb: f64) -> BatchCost {
        cost(p, 1.0, if p == Codec::Lz4 { 100.0 } else { 50.0 }, link_mb)
    }

    #[test]
    fn auto_tries_a_clear_loser_less_and_less_and_a_contender_as_often() {
        // A link far faster than either codec, incompressible pages: both codecs lose by far.
        let mut c = Chooser::default();
        let picks = run(&mut c, 2000, |p| random(p, 5000.0));
        let tries = picks.iter().filter(|p| **p != Codec::None).count();
        // At the old pace of one try every 16th batch: 125.
        assert!((4..=30).contains(&tries), "{tries} tries");
        // Each codec is still tried at least every `PROBE_MOST` batches.
        for codec in [Codec::Lz4, Codec::Zstd] {
            let at: Vec<usize> = (0..picks.len()).filter(|&i| picks[i] == codec).collect();
            let gaps = at
                .windows(2)
                .map(|w| w[1] - w[0])
                .chain([picks.len() - at[at.len() - 1]]);
            assert!(
                gaps.into_iter().all(|g| g <= PROBE_MOST as usize + 2),
                "{at:?}"
            );
        }
        // A contender within a fifth of the pick (lz4 here just behind zstd) keeps its pace.
        let text = |p| match p {
            Codec::None => cost(p, 1.0, 0.0, 125.0),
            Codec::Lz4 => cost(p, 0.33, 900.0, 125.0),
            Codec::Zstd => cost(p, 0.3, 900.0, 125.0),
        };
        let mut c = Chooser::default();
        let picks = run(&mut c, 320, text);
        assert_eq!(c.best(), Codec::Zstd);
        let lz4 = picks.iter().filter(|p| **p == Codec::Lz4).count();
        assert!(lz4 >= 320 / PROBE_EVERY as usize - 1, "{lz4} tries of lz4");
    }

    #[test]
    fn auto_notices_new_pages_or_a_new_link_after_putting_tries_off() {
        let mut c = Chooser::default();
        run(&mut c, 2000, |p| random(p, 5000.0));
        // The pages turn text-like and the link slows to 1 Gbit: zstd wins within a few tries.
        let slow_text = |p| match p {
            Codec::None => cost(p, 1.0, 0.0, 125.0),
            Codec::Lz4 => cost(p, 0.45, 900.0, 125.0),
            Codec::Zstd => cost(p, 0.3, 400.0, 125.0),
        };
        let picks = run(&mut c, 2 * PROBE_MOST as usize, slow_text);
        assert_eq!(c.best(), Codec::Zstd);
        // The new link rate is news: every codec is tried again within `PROBE_EVERY` batches
        // and compression wins at once; zstd's estimate takes a few more tries to catch up
        // with the new pages, and then it is the pick but for tries.
        let soon = &picks[PROBE_EVERY as usize..2 * PROBE_EVERY as usize];
        let plain = soon.iter().filter(|p| **p == Codec::None).count();
        assert!(plain <= 2, "{picks:?}");
        let late = &picks[PROBE_MOST as usize..];
        let zstd = late.iter().filter(|p| **p == Codec::Zstd).count();
        assert!(zstd * 10 >= late.len() * 9, "{picks:?}");
        // Only the pages change (incompressible, then text-like, on 1 Gbit throughout): the
        // put-off codecs' next try, at most `PROBE_MOST` batches away, finds them winning.
        let mut c = Chooser::default();
        run(&mut c, 2000, |p| random(p, 125.0));
        let picks = run(&mut c, PROBE_MOST as usize + 64, slow_text);
        let first = picks.iter().position(|p| *p != Codec::None).unwrap();
        assert!(first <= PROBE_MOST as usize, "first compressed at {first}");
        let plain = picks[first..first + 48]
            .iter()
            .filter(|p| **p == Codec::None);
        assert!(plain.count() <= 2, "{picks:?}");
        // Only the link changes (the same incompressible pages, now on 1 Gbit): a new rate is
        // news, so the put-off codecs are tried again at once, and found still to lose.
        let mut c = Chooser::default();
        run(&mut c, 2000, |p| random(p, 5000.0));
        let picks = run(&mut c, 2 * PROBE_EVERY as usize, |p| random(p, 125.0));
        assert!(picks.contains(&Codec::Lz4) && picks.contains(&Codec::Zstd));
        assert_eq!(c.best(), Codec::None);
    }

    #[test]
    fn auto_weighs_a_codec_by_the_cores_that_run_it() {
        // A 1 GB/s link, text-like data: per MB, plain takes 1 ms; on one core zstd
        // (0.3 at 400 MB/s) paces at 2.5 ms and lz4 (0.45 at 900 MB/s) at 1.1 ms; on four,
        // lz4 at max(0.28, 0.45) beats zstd's max(0.63, 0.3); on eight, zstd's 0.31 wins.
        let text = [(0.45, 900.0), (0.3, 400.0)];
        assert_eq!(trained(1000.0, text).best(), Codec::None);
        assert_eq!(trained(1000.0, text).on_cores(4).best(), Codec::Lz4);
        assert_eq!(trained(1000.0, text).on_cores(8).best(), Codec::Zstd);
    }

    /// A chooser that has seen four batches of each codec: (ratio, MB/s) for lz4 and zstd.
    fn trained(link_mb: f64, codecs: [(f64, f64); 2]) -> Chooser {
        let mut c = Chooser::default();
        for _ in 0..4 {
            c.learn(cost(Codec::None, 1.0, 0.0, link_mb));
            for (codec, (ratio, speed)) in [Codec::Lz4, Codec::Zstd].into_iter().zip(codecs) {
                c.learn(cost(codec, ratio, speed, link_mb));
            }
        }
        c
    }

    #[test]
    fn auto_tries_each_codec_then_probes_now_and_then() {
        let mut c = Chooser::default();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..3 {
            let pick = c.pick();
            seen.insert(pick);
            c.learn(cost(pick, 0.5, 500.0, 100.0));
        }
        assert_eq!(seen.len(), 3, "each codec measured once first");
        let picks: Vec<Codec> = (0..PROBE_EVERY * 2)
            .map(|_| {
                let p = c.pick();
                c.learn(cost(
                    p,
                    if p == Codec::None { 1.0 } else { 0.5 },
                    500.0,
                    100.0,
                ));
                p
            })
            .collect();
        assert!(picks.contains(&Codec::None), "the loser is probed again");
    }
}
