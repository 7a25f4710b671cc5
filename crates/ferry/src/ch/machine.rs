//! A `VmSpec` made into a running ferry VM, and a VM that arrived described as a `VmSpec`.

use api::ApiError;
use api::ch::{ConsoleMode, Disk, Net, VmSpec};
use vmm::cpuid::CpuModel;
use vmm::{BootImage, DiskConfig, MemoryBackend, NetConfig, Vm, VmConfig};

use crate::run;

/// Boot failures are the VMM's (500), as CH answers a `vm.boot` that cannot start.
fn failed(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(format!("the VM could not boot: {e:#}"))
}

/// A PVH ELF boots by its PVH entry (with `vcpus=N` on its command line, which ferry's
/// workload guest reads); a Linux kernel (a bzImage, or a vmlinux even with a PVH note),
/// or an ELF with an initramfs, by the Linux protocol, as `ferry run --kernel` boots it.
fn image(spec: &VmSpec) -> Result<(BootImage, String), ApiError> {
    run::check_file("payload.kernel", spec.kernel.as_ref()).map_err(failed)?;
    let mut magic = [0u8; 4];
    let elf = std::fs::File::open(&spec.kernel)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && magic == *b"\x7fELF";
    let kernel = std::path::Path::new(&spec.kernel);
    if elf && spec.initramfs.is_none() && !vmm::boot::is_linux_elf(kernel) {
        let cmdline = run::cmdline_with_vcpus(&spec.cmdline, spec.vcpus).map_err(failed)?;
        return Ok((BootImage::Pvh(spec.kernel.clone().into()), cmdline));
    }
    let initrd = spec.initramfs.as_ref().map(std::path::PathBuf::from);
    if let Some(i) = &initrd {
        run::check_file("payload.initramfs", i).map_err(failed)?;
    }
    let image = BootImage::Linux {
        kernel: spec.kernel.clone().into(),
        initrd,
    };
    Ok((image, spec.cmdline.clone()))
}

fn config(spec: &VmSpec) -> Result<VmConfig, ApiError> {
    let nets = spec
        .nets
        .iter()
        .map(|n| {
            let text = match &n.mac {
                Some(mac) => format!("tap={},mac={mac}", n.tap),
                None => format!("tap={}", n.tap),
            };
            let config = text.parse::<NetConfig>().map_err(ApiError::bad_request)?;
            Ok(NetConfig {
                file: n.file.clone(),
                ..config
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(VmConfig {
        memory: spec.memory_bytes,
        vcpus: spec.vcpus,
        backend: if spec.shared_memory {
            MemoryBackend::Memfd
        } else {
            MemoryBackend::Anonymous
        },
        disks: spec
            .disks
            .iter()
            .map(|d| DiskConfig {
                path: d.path.clone().into(),
                readonly: d.readonly,
            })
            .collect(),
        nets,
        balloon: None,
        cpu_model: CpuModel::default(),
    })
}

/// Boots `spec`'s payload, its serial port writing to `serial`.
pub fn boot(spec: &VmSpec, serial: Box<dyn std::io::Write + Send>) -> Result<Vm, ApiError> {
    let (image, cmdline) = image(spec)?;
    let config = config(spec)?;
    run::boot_vm(config, &image, &cmdline, serial).map_err(failed)
}

/// What `vm.info` says of a VM that arrived (by migration or restore): its shape; it has no
/// payload here to boot again.
pub fn spec_of(vm: &Vm, serial: &ConsoleMode) -> VmSpec {
    let c = vm.config();
    VmSpec {
        kernel: String::new(),
        cmdline: String::new(),
        initramfs: None,
        memory_bytes: c.memory,
        shared_memory: c.backend == MemoryBackend::Memfd,
        vcpus: c.vcpus,
        disks: c
            .disks
            .iter()
            .map(|d| Disk {
                path: d.path.display().to_string(),
                readonly: d.readonly,
            })
            .collect(),
        nets: c
            .nets
            .iter()
            .map(|n| Net {
                tap: n.tap.clone(),
                mac: n.mac.as_ref().map(vmm::devices::virtio::net::format_mac),
                file: None,
                id: None,
            })
            .collect(),
        serial: serial.clone(),
        console: ConsoleMode::Off,
    }
}
