//! Disk blocks (`copy_storage`) packed as pages are: each run of blocks goes with the codec
//! the parameters name, or with `auto`'s pick. `auto` keeps a chooser of its own for the
//! disks (their data compresses unlike memory: a file system's text and binaries, or
//! encrypted and media blocks that do not shrink), fed by every run sent and by the link's
//! delivery windows, as a page sender's is (plain to a receiver on this host, unless the
//! windows show a slow, shaped path to it). A run goes packed only where the codec shrank it.

use std::time::{Duration, Instant};

use super::auto::LinkProbe;
use super::policy::{BatchCost, Chooser, SAMPLE_SHARE};
use crate::error::Result;
use crate::io::transport::Stream;
use crate::params::Compression;
use crate::wire::codec::{Codec, Contexts};

/// A packed run goes only where it is at most this share of the raw one: below that the
/// receiver's unpacking is not paid back.
const WORTH: f64 = 0.9;
/// Bytes in each piece `auto` samples of a run (as pages are sampled).
const PIECE: usize = crate::PAGE_SIZE;

pub struct BlockPacker {
    compression: Compression,
    chooser: Chooser,
    link: Option<LinkProbe>,
    contexts: Contexts,
    packed: Vec<u8>,
    sample: Vec<u8>,
    /// Bytes written on the connection by this packer's runs, for the link's windows.
    written: u64,
    /// When the last run's write ended, and its codec (what a run costs, all told).
    last_written: Option<(Instant, Codec)>,
}

/// A run as it goes: packed by `codec`, or raw (`Codec::None`).
pub struct Packed<'a> {
    pub codec: Codec,
    pub data: &'a [u8],
    /// What packing (and sampling) took.
    pub took: Duration,
}

impl BlockPacker {
    /// A packer for runs written on `stream` (`None`: no link windows); `same_host`: the
    /// receiver runs on this host, whose cores would unpack what this one packs.
    pub fn new(compression: Compression, stream: Option<&Stream>, same_host: bool) -> Self {
        let chooser = Chooser::default().on_cores(1.0);
        Self {
            compression,
            chooser: match same_host {
                true => chooser.for_a_peer_on_this_host(),
                false => chooser,
            },
            link: stream.and_then(|s| s.try_clone().ok()).map(LinkProbe::new),
            contexts: Contexts::default(),
            packed: Vec::new(),
            sample: Vec::new(),
            written: 0,
            last_written: None,
        }
    }

    /// `raw` as it goes: packed where the codec chosen shrinks it enough, else as it is.
    pub fn pack<'a>(&'a mut self, raw: &'a [u8]) -> Result<Packed<'a>> {
        let started = Instant::now();
        let codec = self.choose(raw)?;
        if codec != Codec::None {
            self.contexts.prepare(codec)?;
            codec.compress(raw, &mut self.packed, &mut self.contexts)?;
            if self.packed.len() as f64 <= raw.len() as f64 * WORTH {
                return Ok(Packed {
                    codec,
                    data: &self.packed,
                    took: started.elapsed(),
                });
            }
        }
        Ok(Packed {
            codec: Codec::None,
            data: raw,
            took: started.elapsed(),
        })
    }

    /// The codec for a run; `auto` may first measure another on a sample of it.
    fn choose(&mut self, raw: &[u8]) -> Result<Codec> {
        Ok(match self.compression {
            Compression::None => Codec::None,
            Compression::Fixed(c) => c,
            Compression::Auto => {
                let pick = self.chooser.pick(true);
                if let Some(tried) = pick.sample {
                    self.measure_sample(raw, tried)?;
                }
                pick.send
            }
        })
    }

    /// Packs one piece in `SAMPLE_SHARE` of `raw` with `codec`, for `auto` to learn from.
    fn measure_sample(&mut self, raw: &[u8], codec: Codec) -> Result<()> {
        self.contexts.prepare(codec)?;
        let started = Instant::now();
        self.sample.clear();
        raw.chunks(PIECE)
            .step_by(SAMPLE_SHARE)
            .for_each(|p| self.sample.extend_from_slice(p));
        codec.compress(&self.sample, &mut self.packed, &mut self.contexts)?;
        let took = started.elapsed();
        self.chooser
            .learn_sample(codec, self.sample.len(), self.packed.len(), took);
        Ok(())
    }

    /// A run of `raw` bytes went as `wire` bytes with `codec`, packed in `took`, its write
    /// held the sender `write_time`: `auto` learns from it.
    pub fn sent(&mut self, codec: Codec, raw: usize, wire: u64, took: Duration, write: Duration) {
        self.written += wire;
        if self.compression != Compression::Auto {
            return;
        }
        let now = Instant::now();
        let since = self.last_written.replace((now, codec));
        self.chooser.learn(BatchCost {
            codec,
            raw_bytes: raw,
            packed_bytes: wire as usize,
            compress_time: took,
            write_time: write,
            cycle: since
                .filter(|&(_, before)| before == codec)
                .map(|(t, _)| now - t),
        });
        if let Some(sample) = self.link.as_mut().and_then(|l| l.look(self.written)) {
            self.chooser.learn_link(sample);
        }
    }

    /// The sender stopped writing runs for a while (the pages of a round went between):
    /// neither a link window nor a run's whole cost spans that.
    pub fn paused(&mut self) {
        self.last_written = None;
        if let Some(link) = &mut self.link {
            link.restart();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(len: usize) -> Vec<u8> {
        b"a file system holds text, like this line, and code; "
            .iter()
            .copied()
            .cycle()
            .take(len)
            .collect()
    }

    #[test]
    fn a_named_codec_packs_what_shrinks_and_sends_the_rest_as_it_is() {
        let mut p = BlockPacker::new(Compression::Fixed(Codec::Lz4), None, false);
        let raw = text(1 << 20);
        let packed = p.pack(&raw).unwrap();
        assert_eq!(packed.codec, Codec::Lz4);
        assert!(packed.data.len() < raw.len() / 4, "{}", packed.data.len());
        let mut back = vec![0; raw.len()];
        let n = Codec::Lz4
            .decompress(packed.data, &mut back, raw.len())
            .unwrap();
        assert_eq!(&back[..n], &raw[..]);
        let random = crate::test_data::noise(7, 1 << 20);
        let as_is = p.pack(&random).unwrap();
        assert_eq!((as_is.codec, as_is.data.len()), (Codec::None, random.len()));
        let mut none = BlockPacker::new(Compression::None, None, false);
        assert_eq!(none.pack(&raw).unwrap().codec, Codec::None);
    }

    #[test]
    fn auto_packs_a_compressible_disk_for_a_slow_link_and_never_for_this_host() {
        let raw = text(1 << 20);
        let mut slow = BlockPacker::new(Compression::Auto, None, false);
        let mut here = BlockPacker::new(Compression::Auto, None, true);
        let mut packed_runs = 0;
        for _ in 0..64 {
            let p = slow.pack(&raw).unwrap();
            let (codec, wire, took) = (p.codec, p.data.len() as u64, p.took);
            packed_runs += usize::from(codec != Codec::None);
            // A 1 Gbit/s link: each byte holds the writer 8 ns.
            let write = Duration::from_nanos(wire * 8);
            slow.sent(codec, raw.len(), wire, took, write);
            let p = here.pack(&raw).unwrap();
            assert_eq!(p.codec, Codec::None, "a receiver on this host gets plain");
        }
        assert!(packed_runs >= 48, "{packed_runs} of 64 runs packed");
    }
}
