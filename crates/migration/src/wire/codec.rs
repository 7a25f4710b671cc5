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
                ctx.zstd()?
                    .compress_to_buffer(input, out)
                    .map_err(zstd_error)?;
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

impl Contexts {
    /// Makes what `codec` needs now, so that timing its first batch does not count it: a
    /// zstd context sets up its tables on first use (the first 16 KiB took ~2 ms here, 50
    /// times a later one), so a new one packs 260 KiB of zeros, which sets up the tables for
    /// inputs over 256 KiB, the largest zstd sizes its tables for.
    pub fn prepare(&mut self, codec: Codec) -> Result<()> {
        if codec == Codec::Zstd && self.zstd.is_none() {
            let zeros = vec![0u8; 260 << 10];
            let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(zeros.len()));
            self.zstd()?
                .compress_to_buffer(&zeros, &mut out)
                .map_err(zstd_error)?;
        }
        Ok(())
    }

    fn zstd(&mut self) -> Result<&mut zstd::bulk::Compressor<'static>> {
        if self.zstd.is_none() {
            self.zstd = Some(zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(zstd_error)?);
        }
        Ok(self.zstd.as_mut().expect("made above"))
    }
}

fn zstd_error(e: std::io::Error) -> Error {
    Error::State(format!("zstd: {e}"))
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
/// Each codec is tried before it can be picked, and then every `PROBE_EVERY` batches the one
/// tried least recently, so a change in the data or the link is seen. How it is tried
/// depends on the best pick:
/// - plain (the link is faster than the codecs, or the data does not shrink): on a sample of
///   the batch's pages (`SAMPLE_SHARE`), while the batch goes plain. Whole batches tried cost
///   `auto` a third more time than plain on a link faster than every codec.
/// - a codec (the link is slower than the codecs): the whole batch goes with the one tried,
///   plain included, which costs little there and tells exactly: a sample misjudges zstd's
///   ratio (0.59 on 16 KiB samples against 0.49 on whole batches of `fill=mixed`), so a
///   codec's first whole batch starts its estimates afresh.
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
    /// The batch each codec was last tried for (0: never; with packer threads a try is
    /// learned from batches later), the samples it was measured on, and whether it has been
    /// measured on a whole batch yet (then that alone counts, as it did before samples).
    last_tried: [u64; 3],
    samples: [u32; 3],
    from_batches: [bool; 3],
    batches: u64,
    /// Threads compressing this sender's batches side by side (0 or 1: the sender itself).
    cores: usize,
    /// The best pick at the last batch (its changes are logged).
    last_best: Option<Codec>,
}

/// What `auto` does with the next batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    /// The codec the batch goes with.
    pub send: Codec,
    /// A codec due for measuring on a sample of the batch's pages, if any.
    pub sample: Option<Codec>,
}

/// A sample is one page in this many of a batch (at least one page), from all over it: one
/// every `PROBE_EVERY` batches costs a 256th of packing every batch.
pub const SAMPLE_SHARE: usize = 16;
const PROBE_EVERY: u64 = 16;
/// Weight of the newest measurement in every average (the first few samples of a codec: a
/// plain mean, so that an untypical first one soon counts little).
const EWMA_NEW: f64 = 0.25;

/// `old` with the `n`-th sample `new` averaged in.
fn average(old: Option<f64>, new: f64, n: u32) -> Option<f64> {
    let weight = (1.0 / f64::from(n.max(1))).max(EWMA_NEW);
    Some(old.map_or(new, |o| o + weight * (new - o)))
}

impl Chooser {
    /// A chooser for a sender whose batches `cores` threads compress side by side: a codec's
    /// speed per core counts that many times.
    pub fn on_cores(mut self, cores: usize) -> Self {
        self.cores = cores;
        self
    }

    /// The codec for the next batch, and one to measure on a sample of it when `may_sample`
    /// (the batch has page data, and no one waits for it alone).
    pub fn pick(&mut self, may_sample: bool) -> Pick {
        self.batches += 1;
        let best = self.best();
        let others = || Codec::ALL.into_iter().filter(move |&c| c != best);
        let unknown = |c: Codec| c != Codec::None && self.last_tried[c.index()] == 0;
        let due = if others().any(unknown) {
            others()
                .filter(|&c| unknown(c))
                .min_by_key(|c| self.last_tried[c.index()])
        } else if self.batches.is_multiple_of(PROBE_EVERY) {
            others().min_by_key(|c| self.last_tried[c.index()])
        } else {
            None
        };
        let pick = match due {
            Some(c) if best == Codec::None => Pick {
                send: best,
                sample: may_sample.then_some(c),
            },
            Some(c) => Pick {
                send: c,
                sample: None,
            },
            None => Pick {
                send: best,
                sample: None,
            },
        };
        for c in [Some(pick.send), pick.sample].into_iter().flatten() {
            self.last_tried[c.index()] = self.batches;
        }
        if self.last_best.replace(best) != Some(best) {
            tracing::debug!(
                "auto: now {} (link {:.0} MB/s; MB/s per core and ratio: lz4 {:?} {:?}, \
                 zstd {:?} {:?})",
                best.name(),
                self.link.unwrap_or(f64::INFINITY) / 1e6,
                self.speed[1].map(|s| (s / 1e6).round()),
                self.ratio[1],
                self.speed[2].map(|s| (s / 1e6).round()),
                self.ratio[2],
            );
        }
        pick
    }

    /// The codec with the smallest expected time per raw byte (the first of equals: plain;
    /// a codec not yet measured never).
    pub fn best(&self) -> Codec {
        let link = self.link.unwrap_or(f64::INFINITY).max(1.0);
        let cost = |c: Codec| {
            let ratio = self.ratio[c.index()].unwrap_or(1.0);
            let compress = match (c, self.speed[c.index()]) {
                (Codec::None, _) => 0.0,
                (_, Some(s)) if s > 0.0 => 1.0 / (s * self.cores.max(1) as f64),
                _ => f64::INFINITY,
            };
            f64::max(compress, ratio / link)
        };
        *Codec::ALL
            .iter()
            .min_by(|a, b| cost(**a).total_cmp(&cost(**b)))
            .expect("three codecs")
    }

    /// A batch that went on the wire: the codec's ratio and speed, and the link's rate.
    pub fn learn(&mut self, b: BatchCost) {
        if b.raw_bytes == 0 {
            return;
        }
        let i = b.codec.index();
        if !self.from_batches[i] {
            self.from_batches[i] = true;
            (self.ratio[i], self.speed[i]) = (None, None);
        }
        self.learn_codec(
            b.codec,
            b.raw_bytes,
            b.packed_bytes,
            b.compress_time,
            u32::MAX,
        );
        if !self.drained_samples {
            let w = b.write_time.as_secs_f64().max(1e-7);
            self.link = average(self.link, b.packed_bytes as f64 / w, u32::MAX);
        }
    }

    /// `codec` packed a sample of `raw` bytes into `packed` in `took` (nothing was sent).
    pub fn learn_sample(&mut self, codec: Codec, raw: usize, packed: usize, took: Duration) {
        if raw > 0 {
            // A codec that did not shrink the sample would have sent it plain: a ratio of 1.
            // The first few samples are averaged alike: the first may come from untypical
            // memory (a guest's random pool).
            let i = codec.index();
            self.samples[i] += 1;
            let n = if self.from_batches[i] {
                u32::MAX
            } else {
                self.samples[i]
            };
            self.learn_codec(codec, raw, packed.min(raw), took, n);
        }
    }

    /// Averages in the `n`-th measurement of `codec` (`u32::MAX`: one of many).
    fn learn_codec(&mut self, codec: Codec, raw: usize, packed: usize, took: Duration, n: u32) {
        let i = codec.index();
        self.ratio[i] = average(self.ratio[i], packed as f64 / raw as f64, n);
        if codec != Codec::None {
            let t = took.as_secs_f64().max(1e-7);
            self.speed[i] = average(self.speed[i], raw as f64 / t, n);
        }
    }

    /// The link carried `bytes_per_s` while its send queue stayed short: it is at least that
    /// fast. (Drain rates come only while data waits; a sender slower than the link, one
    /// that compresses, sees none, and an estimate taken in a slow moment would stand.)
    /// It counts as one more sample where above the estimate: one connection of several
    /// may take more than its share of a shared link for a moment.
    pub fn link_at_least(&mut self, bytes_per_s: f64) {
        if self.link.is_some_and(|l| l < bytes_per_s) {
            self.link = average(self.link, bytes_per_s, u32::MAX);
        }
    }

    /// A measured drain rate of the link (bytes/s), taken while data waited in the send queue.
    pub fn learn_link(&mut self, bytes_per_s: f64) {
        if !self.drained_samples {
            self.drained_samples = true;
            self.link = None;
        }
        self.link = average(self.link, bytes_per_s, u32::MAX);
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

    /// While plain is the best pick, each codec is tried on a sample of a batch with
    /// page data, then in turn every `PROBE_EVERY` batches; while a codec is, the others
    /// (plain included) are tried on whole batches.
    #[test]
    fn auto_tries_codecs_on_samples_while_plain_wins_and_on_batches_while_one_does() {
        let mut c = Chooser::default();
        let plain = Pick {
            send: Codec::None,
            sample: None,
        };
        assert_eq!(c.pick(false), plain, "nothing to sample: nothing tried");
        let first: Vec<Pick> = (0..2).map(|_| c.pick(true)).collect();
        let on_samples = |codec| Pick {
            send: Codec::None,
            sample: Some(codec),
        };
        assert_eq!(
            first,
            [Codec::Lz4, Codec::Zstd].map(on_samples),
            "each codec on a sample, before either is learned"
        );
        let later: Vec<Pick> = (0..PROBE_EVERY * 2).map(|_| c.pick(true)).collect();
        let tries: Vec<&Pick> = later.iter().filter(|p| **p != plain).collect();
        assert_eq!(tries, [&on_samples(Codec::Lz4), &on_samples(Codec::Zstd)]);

        // A slow link (1 Gbit) and text-like data: lz4 (ratio 0.45 at 900 MB/s) wins.
        c.learn(cost(Codec::None, 1.0, 0.0, 125.0));
        c.learn_sample(Codec::Lz4, 1 << 20, 470_000, Duration::from_micros(1165));
        c.learn_sample(Codec::Zstd, 1 << 20, 315_000, Duration::from_micros(6000));
        let picks: Vec<Pick> = (0..PROBE_EVERY * 4).map(|_| c.pick(true)).collect();
        let tries: Vec<Codec> = picks
            .iter()
            .filter(|p| p.send != Codec::Lz4)
            .map(|p| p.send)
            .collect();
        assert!(picks.iter().all(|p| p.sample.is_none()), "{picks:?}");
        assert_eq!(tries.len(), 4, "{picks:?}");
        assert!(
            tries.windows(2).all(|w| w[0] != w[1]),
            "plain and zstd in turn, as whole batches: {tries:?}"
        );
    }

    /// An idle send queue says the link took all it was given: the estimate rises toward it
    /// (a slow moment's estimate does not stand while compressing keeps the queue idle), and
    /// never falls by it.
    #[test]
    fn auto_raises_a_link_estimate_the_link_outran() {
        let mut c = Chooser::default();
        c.learn_link(100e6);
        c.learn_sample(Codec::Lz4, 1 << 20, 500_000, Duration::from_micros(2500));
        assert_eq!(
            c.best(),
            Codec::Lz4,
            "400 MB/s lz4 halves what a 100 MB/s link moves"
        );
        c.link_at_least(50e6);
        assert_eq!(
            c.best(),
            Codec::Lz4,
            "a floor below the estimate changes nothing"
        );
        c.link_at_least(2e9);
        assert_eq!(c.best(), Codec::None, "the link took 2 GB/s: plain wins");
    }

    /// A sample that did not shrink counts as a ratio of 1 (it would have gone plain); the
    /// first four measurements are averaged alike, so an untypical first one soon counts
    /// little; a codec's first whole batch starts its estimates afresh.
    #[test]
    fn auto_learns_from_samples_and_trusts_whole_batches_more() {
        let mut c = Chooser::default();
        c.learn_link(125e6);
        c.learn_sample(Codec::Zstd, 1 << 20, 1_050_000, Duration::from_micros(2000));
        assert_eq!(c.best(), Codec::None, "incompressible: plain");
        for _ in 0..2 {
            c.learn_sample(Codec::Zstd, 1 << 20, 300_000, Duration::from_micros(2500));
        }
        assert_eq!(c.best(), Codec::Zstd, "the data changed: zstd now wins");
        // Samples said lz4 does not shrink this; a whole batch says it halves it, fast.
        for _ in 0..4 {
            c.learn_sample(Codec::Lz4, 1 << 20, 1_050_000, Duration::from_micros(1000));
        }
        c.learn(cost(Codec::Lz4, 0.2, 1000.0, 125.0));
        assert_eq!(c.best(), Codec::Lz4, "the batch's measure stands alone");
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
}
