//! The CPU model a guest's vCPUs advertise through CPUID.
//!
//! - `host`: everything this host's KVM supports (`KVM_GET_SUPPORTED_CPUID`), as Cloud
//!   Hypervisor and Firecracker pass it through.
//! - `baseline`: the host's model without the features a kernel uses in ring 0 that a KVM
//!   running guest kernels in its instruction emulator (PVM) cannot execute: XSAVE and the
//!   AVX family, SMEP/SMAP, UMIP, PKU, FSGSBASE, PCID/INVPCID, POPCNT/LZCNT/MOVBE, BMI1/2,
//!   ADX, ERMS/FSRM, CLWB/CLFLUSHOPT, RDRAND/RDSEED/RDPID, SHA, x2APIC ([`HIDDEN`]).
//!
//! The model is fixed when a VM is created and travels in each vCPU's state, so a migrated or
//! restored VM keeps the one it booted with; a destination that cannot provide it refuses
//! before anything crosses (`state::check_cpuid`).
//!
//! A KVM may not honour the model: PVM fills leaves 1, 7 and 0xd back in with the processor's
//! own bits after `KVM_SET_CPUID2` (its guests' user mode runs natively). What it kept is
//! read back; a Linux guest is then told on its command line to leave those features alone
//! ([`linux_words`]): the one place left to say it, since CPUID no longer can.

use std::str::FromStr;

use kvm_bindings::{CpuId, kvm_cpuid_entry2};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuModel {
    Host,
    Baseline,
}

/// Where KVM runs guest kernels in its instruction emulator (this module exists only there).
const PVM_MODULE: &str = "/sys/module/kvm_pvm";

impl Default for CpuModel {
    /// `baseline` on a KVM that emulates guest kernels (PVM), where a `host` model advertises
    /// instructions its emulator cannot run; `host` elsewhere.
    fn default() -> Self {
        if std::path::Path::new(PVM_MODULE).exists() {
            Self::Baseline
        } else {
            Self::Host
        }
    }
}

impl FromStr for CpuModel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "host" => Ok(Self::Host),
            "baseline" => Ok(Self::Baseline),
            other => Err(format!(
                "unknown CPU model '{other}' (use host or baseline)"
            )),
        }
    }
}

impl std::fmt::Display for CpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Host => "host",
            Self::Baseline => "baseline",
        })
    }
}

/// A CPUID register that carries feature flags, and Linux's number for its word of
/// capability bits (`enum cpuid_leafs` in arch/x86/include/asm/cpufeature.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Word {
    Leaf1Ecx,
    Leaf7Ebx,
    Leaf7Ecx,
    Leaf7Edx,
    Ext1Ecx,
}

impl Word {
    fn linux_word(self) -> u32 {
        match self {
            Self::Leaf1Ecx => 4,
            Self::Ext1Ecx => 6,
            Self::Leaf7Ebx => 9,
            Self::Leaf7Ecx => 16,
            Self::Leaf7Edx => 18,
        }
    }

    /// The register in `cpuid`'s entry for this word, if the entry is there.
    fn register(self, e: &mut kvm_cpuid_entry2) -> Option<&mut u32> {
        match (e.function, e.index, self) {
            (0x1, _, Self::Leaf1Ecx) => Some(&mut e.ecx),
            (0x7, 0, Self::Leaf7Ebx) => Some(&mut e.ebx),
            (0x7, 0, Self::Leaf7Ecx) => Some(&mut e.ecx),
            (0x7, 0, Self::Leaf7Edx) => Some(&mut e.edx),
            (0x8000_0001, _, Self::Ext1Ecx) => Some(&mut e.ecx),
            _ => None,
        }
    }
}

/// One feature `baseline` hides: where its bit lies, and its name in /proc/cpuinfo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Feature {
    pub word: Word,
    pub bit: u32,
    pub name: &'static str,
}

const fn f(word: Word, bit: u32, name: &'static str) -> Feature {
    Feature { word, bit, name }
}

/// XSAVE: Linux turns it off with `noxsave` rather than `clearcpuid`.
const XSAVE: Feature = f(Word::Leaf1Ecx, 26, "xsave");

/// What `baseline` hides. Each was found stopping a Linux boot in an emulating KVM.
pub const HIDDEN: [Feature; 26] = [
    XSAVE,
    f(Word::Leaf1Ecx, 17, "pcid"),
    f(Word::Leaf1Ecx, 21, "x2apic"),
    f(Word::Leaf1Ecx, 22, "movbe"),
    f(Word::Leaf1Ecx, 23, "popcnt"),
    f(Word::Leaf1Ecx, 28, "avx"),
    f(Word::Leaf1Ecx, 30, "rdrand"),
    f(Word::Ext1Ecx, 5, "abm"),
    f(Word::Leaf7Ebx, 0, "fsgsbase"),
    f(Word::Leaf7Ebx, 3, "bmi1"),
    f(Word::Leaf7Ebx, 5, "avx2"),
    f(Word::Leaf7Ebx, 7, "smep"),
    f(Word::Leaf7Ebx, 8, "bmi2"),
    f(Word::Leaf7Ebx, 9, "erms"),
    f(Word::Leaf7Ebx, 10, "invpcid"),
    f(Word::Leaf7Ebx, 16, "avx512f"),
    f(Word::Leaf7Ebx, 18, "rdseed"),
    f(Word::Leaf7Ebx, 19, "adx"),
    f(Word::Leaf7Ebx, 20, "smap"),
    f(Word::Leaf7Ebx, 23, "clflushopt"),
    f(Word::Leaf7Ebx, 24, "clwb"),
    f(Word::Leaf7Ebx, 29, "sha_ni"),
    f(Word::Leaf7Ecx, 2, "umip"),
    f(Word::Leaf7Ecx, 3, "pku"),
    f(Word::Leaf7Ecx, 22, "rdpid"),
    f(Word::Leaf7Edx, 4, "fsrm"),
];

impl CpuModel {
    /// The CPUID a vCPU of this model gets, from the host's supported one.
    pub fn apply(self, supported: &CpuId) -> CpuId {
        let mut cpuid = supported.clone();
        if self == Self::Baseline {
            for e in cpuid.as_mut_slice() {
                if e.function == 0xd {
                    // No XSAVE, no XSAVE state components.
                    (e.eax, e.ebx, e.ecx, e.edx) = (0, 0, 0, 0);
                }
                for feature in &HIDDEN {
                    if let Some(reg) = feature.word.register(e) {
                        *reg &= !(1 << feature.bit);
                    }
                }
            }
        }
        cpuid
    }

    /// The features this model hides that a vCPU's CPUID (`got`, read back from KVM) still
    /// shows: what KVM did not honour.
    pub fn not_honoured(self, got: &CpuId) -> Vec<Feature> {
        if self == Self::Host {
            return Vec::new();
        }
        let mut entries = got.as_slice().to_vec();
        HIDDEN
            .iter()
            .copied()
            .filter(|feature| {
                entries.iter_mut().any(|e| {
                    feature
                        .word
                        .register(e)
                        .is_some_and(|reg| *reg & (1 << feature.bit) != 0)
                })
            })
            .collect()
    }
}

/// What this host can give a vCPU: `supported`, and any bit KVM put back into a vCPU's CPUID
/// (`got`) on its own, which it will put into every vCPU's (PVM: the processor's own).
pub fn providable(supported: &CpuId, got: &CpuId) -> CpuId {
    let mut all = supported.clone();
    for e in all.as_mut_slice() {
        if let Some(g) = got
            .as_slice()
            .iter()
            .find(|g| g.function == e.function && g.index == e.index)
        {
            (e.eax, e.ebx, e.ecx, e.edx) =
                (e.eax | g.eax, e.ebx | g.ebx, e.ecx | g.ecx, e.edx | g.edx);
        }
    }
    all
}

/// The Linux command-line words that keep a kernel off `features`: `noxsave`, and
/// `clearcpuid=` with Linux's feature numbers (word × 32 + bit: names would not fit the 127
/// characters the kernel reads of it). Empty when there is nothing to keep it off.
pub fn linux_words(features: &[Feature]) -> String {
    let mut words = String::new();
    if features.contains(&XSAVE) {
        words.push_str(" noxsave");
    }
    let numbers: Vec<String> = features
        .iter()
        .filter(|f| **f != XSAVE)
        .map(|f| (f.word.linux_word() * 32 + f.bit).to_string())
        .collect();
    if !numbers.is_empty() {
        words.push_str(" clearcpuid=");
        words.push_str(&numbers.join(","));
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_set(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: u32::MAX,
            ebx: u32::MAX,
            ecx: u32::MAX,
            edx: u32::MAX,
            ..Default::default()
        }
    }

    fn every_leaf_set() -> CpuId {
        CpuId::from_entries(&[
            all_set(1, 0),
            all_set(7, 0),
            all_set(0xd, 0),
            all_set(0x8000_0001, 0),
        ])
        .unwrap()
    }

    #[test]
    fn baseline_hides_its_features_and_host_hides_nothing() {
        let all = every_leaf_set();
        assert_eq!(CpuModel::Host.apply(&all).as_slice(), all.as_slice());
        let base = CpuModel::Baseline.apply(&all);
        let leaf = |f: u32| *base.as_slice().iter().find(|e| e.function == f).unwrap();
        let l1 = leaf(1);
        assert_eq!(l1.edx, u32::MAX, "leaf 1 EDX (x87 to SSE2) stays");
        for (bit, name) in [(23, "POPCNT"), (26, "XSAVE"), (28, "AVX"), (21, "x2APIC")] {
            assert_eq!(l1.ecx & (1 << bit), 0, "{name} hidden");
        }
        for (bit, name) in [
            (0, "SSE3"),
            (20, "SSE4.2"),
            (24, "TSC-deadline"),
            (31, "hypervisor"),
        ] {
            assert_ne!(l1.ecx & (1 << bit), 0, "{name} kept");
        }
        let l7 = leaf(7);
        assert_eq!(l7.ebx & (1 << 20 | 1 << 7), 0, "SMAP and SMEP hidden");
        assert_eq!(leaf(0xd).eax, 0, "no XSAVE state");
        assert_eq!(leaf(0x8000_0001).ecx & (1 << 5), 0, "LZCNT hidden");
        assert_eq!(CpuModel::Baseline.not_honoured(&base), Vec::new());
        assert_eq!(CpuModel::Host.not_honoured(&all), Vec::new());
    }

    /// What KVM put back is found, and Linux is told to leave it alone in words that fit the
    /// 127 characters it reads of `clearcpuid=`.
    #[test]
    fn what_kvm_did_not_honour_becomes_linux_words() {
        let kept = CpuModel::Baseline.not_honoured(&every_leaf_set());
        assert_eq!(kept, HIDDEN.to_vec());
        let words = linux_words(&kept);
        assert!(words.starts_with(" noxsave clearcpuid="), "{words}");
        let list = words.split("clearcpuid=").nth(1).unwrap();
        assert!(list.len() <= 127, "{} characters: {list}", list.len());
        // smap: word 9 (CPUID 7.0 EBX), bit 20; popcnt: word 4 (CPUID 1 ECX), bit 23.
        let numbers: Vec<&str> = list.split(',').collect();
        assert!(
            numbers.contains(&"308") && numbers.contains(&"151"),
            "{list}"
        );
        assert_eq!(numbers.len(), HIDDEN.len() - 1);
        assert_eq!(linux_words(&[]), "");
    }

    #[test]
    fn what_kvm_puts_back_on_its_own_counts_as_providable() {
        let leaf = |ecx: u32| kvm_cpuid_entry2 {
            function: 1,
            ecx,
            ..Default::default()
        };
        let supported = CpuId::from_entries(&[leaf(0x8100_2000)]).unwrap();
        let got = CpuId::from_entries(&[leaf(0xf7d8_3203)]).unwrap();
        let all = providable(&supported, &got);
        assert_eq!(all.as_slice()[0].ecx, 0xf7d8_3203 | 0x8100_2000);
    }

    #[test]
    fn models_are_named_as_the_cli_takes_them() {
        for m in [CpuModel::Host, CpuModel::Baseline] {
            assert_eq!(m.to_string().parse::<CpuModel>().unwrap(), m);
        }
        let e = "skylake".parse::<CpuModel>().unwrap_err();
        assert!(e.contains("use host or baseline"), "{e}");
    }
}
