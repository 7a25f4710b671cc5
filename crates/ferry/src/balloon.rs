//! The balloon at the API edge: `vm.balloon` (its target) and its part of `vm.info`.

use api::{ApiError, BalloonRequest, BalloonStatus};
use vmm::Vm;
use vmm::devices::virtio::balloon::BalloonInfo;

/// Sets the balloon's target: 400 for a malformed or too large one, 409 for a VM without a
/// balloon.
pub fn set_target(vm: &Vm, req: &BalloonRequest) -> Result<(), ApiError> {
    let pages = req.pages().map_err(ApiError::bad_request)?;
    if vm.balloon_info().is_none() {
        return Err(ApiError::conflict(
            "the VM has no balloon (start it with ferry run --balloon)",
        ));
    }
    vm.set_balloon_target(pages)
        .map_err(|e| ApiError::bad_request(migration::error::chain(&e)))
}

/// `vm.info`'s balloon section.
pub fn status(i: BalloonInfo) -> BalloonStatus {
    let (c, s) = (i.counters, i.stats);
    BalloonStatus {
        target_pages: u64::from(i.target_pages),
        actual_pages: u64::from(i.actual_pages),
        deflate_on_oom: i.deflate_on_oom,
        free_page_reporting: i.free_page_reporting,
        free_page_hint: i.free_page_hint,
        pages_inflated: c.inflated_pages,
        pages_deflated: c.deflated_pages,
        pages_reported: c.reported_pages,
        pages_hinted: c.hinted_pages,
        freed_bytes: c.freed_bytes,
        refused: c.refused,
        stats_updates: c.stats_updates,
        guest_free_bytes: s.free_bytes,
        guest_total_bytes: s.total_bytes,
        guest_available_bytes: s.available_bytes,
        guest_swap_in_bytes: s.swap_in_bytes,
        guest_swap_out_bytes: s.swap_out_bytes,
        guest_major_faults: s.major_faults,
        guest_minor_faults: s.minor_faults,
    }
}

/// `ferry balloon`'s target: a size with its unit (`512M`, `1G`) or a number of MiB.
pub fn parse_target(s: &str) -> Result<u64, String> {
    if let Ok(mib) = s.parse::<u64>() {
        return Ok(mib);
    }
    let bytes = s.parse::<vmm::MemorySize>()?.0;
    if !bytes.is_multiple_of(1 << 20) {
        return Err(format!("{s} is not a whole number of MiB"));
    }
    Ok(bytes >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_in_mib() {
        assert_eq!(parse_target("0"), Ok(0));
        assert_eq!(parse_target("300"), Ok(300));
        assert_eq!(parse_target("2G"), Ok(2048));
        assert!(
            parse_target("1000K")
                .unwrap_err()
                .contains("whole number of MiB")
        );
        assert!(parse_target("lots").is_err());
        let both = BalloonRequest {
            target_mib: Some(1),
            target_pages: Some(256),
        };
        assert!(both.pages().is_err());
        assert!(BalloonRequest::default().pages().is_err());
        let pages = BalloonRequest {
            target_mib: Some(3),
            target_pages: None,
        };
        assert_eq!(pages.pages(), Ok(768));
    }
}
