//! Which host this process runs on, as a destination tells its source (`Ready`): whether
//! the receiver shares the sender's cores decides whether packing pages can pay.

use std::sync::OnceLock;

/// A host's identity: a hash of its kernel's boot id, which every process under one running
/// kernel shares (in any namespace: a destination behind a veth in a namespace of its own is
/// on this host all the same), and no other host's does — unless two hosts are VMs restored
/// from one memory image, which `auto` then tells apart only by a slow link's windows.
/// Hashed, so that the peer learns only whether it is the same.
pub type HostId = [u8; 16];

/// This host's identity, or None where the kernel does not say (no /proc).
pub fn this_host() -> Option<HostId> {
    static ID: OnceLock<Option<HostId>> = OnceLock::new();
    *ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        Some(identity_of(boot.trim()))
    })
}

fn identity_of(boot_id: &str) -> HostId {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"ferry host\0");
    ctx.update(boot_id.as_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&ctx.finish().as_ref()[..16]);
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_host_has_one_identity_made_of_its_boot_id() {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
        let id = this_host().expect("Linux says its boot id");
        assert_eq!(this_host(), Some(id));
        assert_eq!(id, identity_of(boot.trim()));
        assert_ne!(id, identity_of("another boot"));
    }
}
