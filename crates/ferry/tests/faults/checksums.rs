//! The memory checksums both sides take at the switch (`--checksum`), compared wherever a
//! report has them. Pre-copy's destination compares them itself and refuses a difference;
//! post-copy's only reports its own at the end, so without this a post-copy that delivered
//! wrong memory would pass.

use api::MigrationStatus;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checksums {
    /// No report had both sides' checksum.
    Missing,
    /// Every checksum any report gave (the source's and the destination's) is the same.
    Equal,
    Differ,
}

impl Checksums {
    pub fn name(self) -> &'static str {
        match self {
            Checksums::Missing => "-",
            Checksums::Equal => "equal",
            Checksums::Differ => "DIFFER",
        }
    }
}

/// Compares the checksums in `reports` (the source's final report, each side's status at the
/// end): all are of the memory at the one switch of this migration, so all must agree.
pub fn compare(reports: &[MigrationStatus]) -> Checksums {
    let source: Vec<u64> = reports
        .iter()
        .filter_map(|r| r.memory_checksum_source)
        .collect();
    let destination: Vec<u64> = reports
        .iter()
        .filter_map(|r| r.memory_checksum_destination)
        .collect();
    let (Some(&first), false) = (source.first(), destination.is_empty()) else {
        return Checksums::Missing;
    };
    if source.iter().chain(&destination).all(|&c| c == first) {
        Checksums::Equal
    } else {
        Checksums::Differ
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(source: Option<u64>, destination: Option<u64>) -> MigrationStatus {
        MigrationStatus {
            memory_checksum_source: source,
            memory_checksum_destination: destination,
            ..Default::default()
        }
    }

    #[test]
    fn checksums_are_compared_across_every_report() {
        assert_eq!(compare(&[report(Some(1), Some(1))]), Checksums::Equal);
        assert_eq!(compare(&[report(Some(1), Some(2))]), Checksums::Differ);
        // The source's report without the destination's (post-copy cut, then carried on),
        // and the destination's with both.
        let cut = report(Some(1), None);
        assert_eq!(
            compare(&[cut.clone(), report(Some(1), Some(2))]),
            Checksums::Differ
        );
        assert_eq!(
            compare(&[cut.clone(), report(None, Some(2))]),
            Checksums::Differ
        );
        assert_eq!(compare(&[cut, report(None, None)]), Checksums::Missing);
        assert_eq!(compare(&[]), Checksums::Missing);
    }
}
