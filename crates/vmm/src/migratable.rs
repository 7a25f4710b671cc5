//! The KVM VM as the migration engine sees it.

use migration::bitmap::Bitmap;
use migration::{DeviceDescriptor, GuestRam, Migratable, VmDescriptor};
use serde::{Serialize, de::DeserializeOwned};

use crate::devices::virtio::balloon::BalloonConfig;
use crate::memory::MemoryBackend;
use crate::persist::{self, Fragment, Fragments};
use crate::vm::{Vm, VmConfig};
use crate::{DiskConfig, NetConfig};

/// Version of the envelope around the state (a vCPU's `Fragment`, the devices' `Fragments`):
/// it changes only if the fragments' own layout does. What a component saves is versioned by
/// the component (`Persist::VERSION`), beside its code.
const FORMAT: u32 = 4;

/// The VM's own words travel to the peer and the API (`Display` only), so they are part of the
/// message, not only its source.
fn vm_err(e: crate::error::Error) -> migration::Error {
    migration::Error::vm_caused("the KVM VM", e)
}

/// A vCPU's or the devices' state as it travels (`Fragment`, `Fragments`); public for the
/// fuzz targets, which make and read it without KVM.
pub fn encode<T: Serialize>(value: &T) -> migration::Result<Vec<u8>> {
    persist::to_bytes(&(FORMAT, value)).map_err(|e| migration::Error::vm(format!("VM state: {e}")))
}

/// The state `encode` wrote (`what` names it in an error): what `load_state` reads first.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> migration::Result<T> {
    let (format, value): (u32, T) = persist::from_bytes(bytes)
        .map_err(|e| migration::Error::Protocol(format!("undecodable {what} state: {e}")))?;
    if format != FORMAT {
        return Err(migration::Error::Protocol(format!(
            "{what} state format {format}, this ferry reads {FORMAT}"
        )));
    }
    Ok(value)
}

impl VmConfig {
    /// The VM's shape, with `devices` (the built devices' own descriptors, in slot order).
    fn descriptor(&self, devices: Vec<DeviceDescriptor>) -> VmDescriptor {
        VmDescriptor {
            memory_bytes: self.memory,
            ranges: crate::layout::ram_ranges(self.memory),
            vcpus: self.vcpus as u32,
            running: true,
            memory_backend: match self.backend {
                MemoryBackend::Anonymous => "anonymous",
                MemoryBackend::Memfd => "memfd",
            }
            .into(),
            devices,
            config: None,
        }
    }

    /// The devices a VM's descriptor names, into `self`; refused if they are not in the slot
    /// order this VMM builds (disks, NICs, at most one balloon last). What they offer is not
    /// taken from it: built here, they offer what this ferry's do, and the arrival compares
    /// (`check_devices`).
    fn take_devices(&mut self, devices: &[DeviceDescriptor]) -> migration::Result<()> {
        let out_of_order = |what: &str| {
            migration::Error::Protocol(format!(
                "the source's devices put a {what} where this ferry cannot: it builds disks, \
                 then NICs, then one balloon"
            ))
        };
        for d in devices {
            if self.balloon.is_some() {
                return Err(out_of_order("device after the balloon"));
            }
            match d {
                DeviceDescriptor::Disk { path, readonly, .. } if self.nets.is_empty() => {
                    self.disks.push(DiskConfig {
                        path: path.into(),
                        readonly: *readonly,
                    })
                }
                DeviceDescriptor::Disk { .. } => return Err(out_of_order("disk after a NIC")),
                DeviceDescriptor::Net { tap, mac, .. } => self.nets.push(NetConfig {
                    tap: tap.clone(),
                    mac: *mac,
                    file: None,
                }),
                DeviceDescriptor::Balloon {
                    target_bytes,
                    deflate_on_oom,
                    free_page_reporting,
                    stats_s,
                    features,
                } => {
                    self.balloon = Some(BalloonConfig {
                        size: *target_bytes,
                        deflate_on_oom: *deflate_on_oom,
                        free_page_reporting: *free_page_reporting,
                        free_page_hint: BalloonConfig::hints_in(*features),
                        stats_s: *stats_s,
                    })
                }
            }
        }
        Ok(())
    }

    pub fn from_descriptor(d: &VmDescriptor) -> migration::Result<Self> {
        let ours = crate::layout::ram_ranges(d.memory_bytes);
        if d.ranges != ours {
            return Err(migration::Error::Protocol(format!(
                "the source's RAM lies at {:x?}; this ferry's memory map for {} bytes puts it at \
                 {ours:x?}",
                d.ranges, d.memory_bytes
            )));
        }
        let mut config = Self {
            disks: Vec::new(),
            nets: Vec::new(),
            balloon: None,
            // The vCPUs' state brings the source's model.
            cpu_model: crate::cpuid::CpuModel::default(),
            memory: d.memory_bytes,
            vcpus: d.vcpus as usize,
            backend: d
                .memory_backend
                .parse()
                .map_err(migration::Error::Protocol)?,
        };
        config.take_devices(&d.devices)?;
        Ok(config)
    }
}

impl Migratable for Vm {
    fn descriptor(&self) -> VmDescriptor {
        VmDescriptor {
            running: self.is_running(),
            config: self.profile_config(),
            ..self.config().descriptor(self.device_descriptors())
        }
    }

    fn is_running(&self) -> bool {
        self.state() == crate::vm::VmState::Running
    }

    fn guest_report(&self, resumed_at_ns: u64, window_ns: u64) -> migration::GuestReport {
        let hb = self.heartbeat();
        migration::GuestReport {
            observed_downtime_ns: hb.observed_downtime_ns(),
            pages_per_s_after: hb.pages_per_second(resumed_at_ns, resumed_at_ns + window_ns),
        }
    }

    fn ram(&self) -> GuestRam {
        // SAFETY: the mappings, and the memfds they map, live as long as the VM.
        unsafe { GuestRam::new(&self.ram_regions()).and_then(|r| r.with_files(&self.ram_files())) }
            .expect("the VM's regions come from its memory map")
    }

    fn start_dirty_log(&self) -> migration::Result<()> {
        self.set_dirty_logging(true).map_err(vm_err)?;
        self.drain_vmm_writes(None); // only writes from now on count
        Ok(())
    }

    fn take_dirty(&self) -> migration::Result<Bitmap> {
        let mut dirty = self.take_dirty_log().map_err(vm_err)?;
        self.drain_vmm_writes(Some(&mut dirty));
        Ok(dirty)
    }

    fn take_last_dirty(&self, into: &mut Bitmap) -> migration::Result<()> {
        self.take_last_dirty_log_into(into).map_err(vm_err)?;
        self.drain_vmm_writes(Some(into));
        Ok(())
    }

    fn forget_dirty(&self, first_gfn: u64, words: &[u64]) -> migration::Result<()> {
        self.forget_dirty_log(first_gfn, words).map_err(vm_err)
    }

    fn stop_dirty_log(&self) -> migration::Result<()> {
        self.set_dirty_logging(false).map_err(vm_err)
    }

    fn pause(&self) -> migration::Result<()> {
        Vm::pause(self).map_err(vm_err)
    }

    fn set_throttle(&self, percent: u8) -> migration::Result<()> {
        Vm::set_throttle(self, percent).map_err(vm_err)
    }

    fn take_throttled(&self) -> std::time::Duration {
        Vm::take_throttled(self)
    }

    fn resume(&self) -> migration::Result<()> {
        Vm::resume(self).map_err(vm_err)
    }

    fn release_devices(&self, keep_locks: bool) -> migration::Result<()> {
        Vm::release_devices(self, keep_locks).map_err(vm_err)
    }

    fn device_files(&self) -> Vec<Option<std::os::fd::RawFd>> {
        Vm::device_files(self)
    }

    fn save_vcpus(&self) -> migration::Result<Vec<Vec<u8>>> {
        self.save_vcpus_state()
            .map_err(vm_err)?
            .iter()
            .map(encode)
            .collect()
    }

    fn save_devices(&self) -> migration::Result<Vec<u8>> {
        encode(&self.save_devices_state().map_err(vm_err)?)
    }

    fn load_state(&self, vcpus: &[Vec<u8>], devices: &[u8]) -> migration::Result<()> {
        let vcpus = vcpus
            .iter()
            .map(|b| decode::<Fragment>(b, "vCPU"))
            .collect::<migration::Result<Vec<_>>>()?;
        let devices = decode::<Fragments>(devices, "device")?;
        self.restore(&vcpus, &devices).map_err(vm_err)?;
        self.claim_devices().map_err(vm_err)
    }

    fn guest_progress_rate(&self, from_ns: u64, to_ns: u64) -> Option<f64> {
        self.heartbeat().pages_per_second(from_ns, to_ns)
    }

    fn hold_page_discards(&self, hold: bool) {
        Vm::hold_page_discards(self, hold);
    }

    fn given_back(&self) -> Option<Bitmap> {
        self.balloon_given_back()
    }

    fn start_free_page_hints(&self) -> bool {
        Vm::start_free_page_hints(self)
    }

    fn free_page_hints_finished(&self) -> bool {
        Vm::free_page_hints_finished(self)
    }

    fn end_free_page_hints(&self) {
        Vm::end_free_page_hints(self)
    }

    fn log_disk_writes(&self) -> migration::Result<Vec<migration::CopiedDisk>> {
        Vm::log_disk_writes(self).map_err(vm_err)
    }

    fn end_disk_logs(&self) {
        Vm::end_disk_logs(self)
    }

    fn disk_targets(&self, slots: &[u32]) -> migration::Result<Vec<std::fs::File>> {
        Vm::disk_targets(self, slots).map_err(vm_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_vmm_builds_the_devices_the_descriptor_names_in_slot_order() {
        let devices = vec![
            DeviceDescriptor::Disk {
                path: "/shared/d.img".into(),
                readonly: true,
                sectors: 2048,
            },
            DeviceDescriptor::Net {
                tap: "tap7".into(),
                mac: Some([2, 0, 0, 0, 0, 7]),
                features: 0x1_0000_0020,
                queues: 2,
            },
            DeviceDescriptor::Balloon {
                target_bytes: 1 << 20,
                deflate_on_oom: false,
                free_page_reporting: true,
                stats_s: 3,
                features: 0x1_0000_0023,
            },
        ];
        let shape = VmConfig {
            memory: 64 << 20,
            vcpus: 2,
            backend: MemoryBackend::Memfd,
            disks: Vec::new(),
            nets: Vec::new(),
            balloon: None,
            cpu_model: crate::cpuid::CpuModel::Host,
        };
        let d = shape.descriptor(devices);
        let built = VmConfig::from_descriptor(&d).unwrap();
        assert_eq!((built.memory, built.vcpus), (64 << 20, 2));
        let disk = DiskConfig {
            path: "/shared/d.img".into(),
            readonly: true,
        };
        assert_eq!(built.disks, vec![disk]);
        assert_eq!(built.nets[0].tap, "tap7");
        assert_eq!(built.nets[0].mac, Some([2, 0, 0, 0, 0, 7]));
        let balloon = built.balloon.unwrap();
        assert_eq!((balloon.size, balloon.stats_s), (1 << 20, 3));
        assert!(!balloon.deflate_on_oom && balloon.free_page_reporting);

        // A slot order this VMM cannot build is refused, naming it.
        let mut swapped = d.clone();
        swapped.devices.swap(0, 1);
        let e = VmConfig::from_descriptor(&swapped).unwrap_err();
        assert!(e.to_string().contains("disk after a NIC"), "{e}");
        let mut late = d;
        late.devices.rotate_left(1);
        let e = VmConfig::from_descriptor(&late).unwrap_err();
        assert!(e.to_string().contains("after the balloon"), "{e}");
    }

    /// An empty VMM (the Cloud Hypervisor profile) builds the disk the descriptor names, at
    /// its path; a file of another size there is refused by name, as the VM describes what it
    /// built, not what it was told.
    #[test]
    fn a_disk_built_from_the_descriptor_is_checked_as_found() {
        if !crate::vm::tests::kvm_here() {
            return;
        }
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(1 << 20).unwrap();
        let path = file.path().display().to_string();
        let shape = crate::vm::tests::bare_config();
        let disk = |sectors| DeviceDescriptor::Disk {
            path: path.clone(),
            readonly: false,
            sectors,
        };
        for (sectors, refused) in [(2048, false), (4096, true)] {
            let d = shape.descriptor(vec![disk(sectors)]);
            let config = VmConfig::from_descriptor(&d).unwrap();
            let vm = Vm::for_restore(config, Box::new(std::io::sink())).unwrap();
            let built = Migratable::descriptor(&vm).devices;
            let checked = migration::check_devices(&d.devices, &built);
            if !refused {
                checked.unwrap();
                continue;
            }
            let e = checked.unwrap_err().to_string();
            let why = format!(
                "virtio slot 0: the VM's disk has 4096 sectors, this destination's {path} has 2048"
            );
            assert!(e.contains(&why), "{e}");
        }
    }
}
