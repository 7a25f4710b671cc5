//! Compression of page data, one frame (batch of pages) at a time: the codecs a page frame's
//! flags name (docs/protocol.md), and how each packs and unpacks. Which codec packs a frame
//! is the sender's choice (`pages::policy`).
//!
//! Codecs come from the field: `lz4_flex` (pure Rust LZ4 block format) and `zstd` (the
//! reference library).

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

    pub(crate) fn index(self) -> usize {
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

fn zstd_error(e: std::io::Error) -> Error {
    Error::State(format!("zstd: {e}"))
}

impl Contexts {
    /// Sets up `codec`'s context before a timed packing, so that `auto` does not count the
    /// setup as the codec's speed: a zstd context sets up its tables on first use (far slower
    /// than a later packing), so a new one packs 260 KiB of zeros,
    /// which sizes its tables for the largest inputs. With the codecs' measures shared by the
    /// connections, a connection's first zstd packing may well be one of `auto`'s measures.
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
}
