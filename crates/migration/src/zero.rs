//! Zero-page detection with the widest SIMD the CPU has (AVX-512, AVX2, else 64-bit words),
//! chosen once at run time.

use std::sync::OnceLock;

use crate::PAGE_SIZE;

type ZeroCheck = fn(&[u8]) -> bool;

/// Which implementation `is_zero_page` uses on this CPU.
pub fn implementation() -> &'static str {
    choose().1
}

/// True when all 4096 bytes of `page` are zero.
pub fn is_zero_page(page: &[u8]) -> bool {
    debug_assert_eq!(page.len(), PAGE_SIZE);
    (choose().0)(page)
}

fn choose() -> &'static (ZeroCheck, &'static str) {
    static CHOICE: OnceLock<(ZeroCheck, &'static str)> = OnceLock::new();
    CHOICE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                return (avx512 as ZeroCheck, "avx512");
            }
            if std::is_x86_feature_detected!("avx2") {
                return (avx2 as ZeroCheck, "avx2");
            }
        }
        (scalar as ZeroCheck, "scalar")
    })
}

pub fn scalar(page: &[u8]) -> bool {
    // SAFETY: any bytes are valid u64s.
    let (head, words, tail) = unsafe { page.align_to::<u64>() };
    head.iter().all(|&b| b == 0)
        && tail.iter().all(|&b| b == 0)
        && words
            .chunks(8)
            .all(|c| c.iter().fold(0, |acc, w| acc | w) == 0)
}

#[cfg(target_arch = "x86_64")]
fn avx2(page: &[u8]) -> bool {
    // SAFETY: chosen only when the CPU has AVX2.
    unsafe { avx2_inner(page) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_inner(page: &[u8]) -> bool {
    use std::arch::x86_64::*;
    let p = page.as_ptr() as *const __m256i;
    // Four loads per 128-byte step; stop at the first non-zero step.
    for step in 0..page.len() / 128 {
        // SAFETY: step * 4 + 3 < page.len() / 32 vectors; unaligned loads.
        let acc = unsafe {
            let base = p.add(step * 4);
            _mm256_or_si256(
                _mm256_or_si256(_mm256_loadu_si256(base), _mm256_loadu_si256(base.add(1))),
                _mm256_or_si256(
                    _mm256_loadu_si256(base.add(2)),
                    _mm256_loadu_si256(base.add(3)),
                ),
            )
        };
        if _mm256_testz_si256(acc, acc) == 0 {
            return false;
        }
    }
    true
}

#[cfg(target_arch = "x86_64")]
fn avx512(page: &[u8]) -> bool {
    // SAFETY: chosen only when the CPU has AVX-512F.
    unsafe { avx512_inner(page) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_inner(page: &[u8]) -> bool {
    use std::arch::x86_64::*;
    let p = page.as_ptr() as *const __m512i;
    for step in 0..page.len() / 256 {
        // SAFETY: step * 4 + 3 < page.len() / 64 vectors; unaligned loads.
        let acc = unsafe {
            let base = p.add(step * 4);
            _mm512_or_si512(
                _mm512_or_si512(_mm512_loadu_si512(base), _mm512_loadu_si512(base.add(1))),
                _mm512_or_si512(
                    _mm512_loadu_si512(base.add(2)),
                    _mm512_loadu_si512(base.add(3)),
                ),
            )
        };
        if _mm512_test_epi64_mask(acc, acc) != 0 {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_impls() -> Vec<ZeroCheck> {
        let mut v: Vec<ZeroCheck> = vec![scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                v.push(avx2);
            }
            if std::is_x86_feature_detected!("avx512f") {
                v.push(avx512);
            }
        }
        v
    }

    #[test]
    fn every_implementation_finds_any_nonzero_byte() {
        let mut page = vec![0u8; PAGE_SIZE + 1];
        // Unaligned too: start at offset 1.
        for f in all_impls() {
            assert!(f(&page[1..]));
            for pos in [0, 1, 31, 32, 127, 128, 255, 256, 2048, 4095] {
                page[1 + pos] = 0x80;
                assert!(!f(&page[1..]), "byte {pos}");
                page[1 + pos] = 0;
            }
        }
        assert!(is_zero_page(&page[..PAGE_SIZE]));
    }
}
