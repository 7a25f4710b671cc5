//! `ferry certs`: a private CA and one certificate per host, for TLS migrations between hosts
//! that trust that CA (each host gets NAME.pem, NAME.key and ca.pem).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{Context, Result};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

use crate::cli::CertsArgs;

pub fn certs(args: &CertsArgs) -> Result<i32> {
    // All checked before anything is written: a bad name leaves no half-made set behind.
    for (i, name) in args.names.iter().enumerate() {
        check_name(name)?;
        if args.names[..i].contains(name) {
            anyhow::bail!("--name {name} is given twice");
        }
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("{}", args.out.display()))?;
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "ferry migration CA");
    let ca = ca_params.self_signed(&ca_key)?;
    write(&args.out.join("ca.pem"), &ca.pem(), 0o644)?;
    write(&args.out.join("ca.key"), &ca_key.serialize_pem(), 0o600)?;
    for name in &args.names {
        let key = KeyPair::generate()?;
        let params = CertificateParams::new(vec![name.clone()])
            .with_context(|| format!("'{name}' is not a host name or address"))?;
        let cert = params.signed_by(&key, &ca, &ca_key)?;
        write(&args.out.join(format!("{name}.pem")), &cert.pem(), 0o644)?;
        write(
            &args.out.join(format!("{name}.key")),
            &key.serialize_pem(),
            0o600,
        )?;
        println!(
            "{name}: --tls-cert {0}/{name}.pem --tls-key {0}/{name}.key --tls-ca {0}/ca.pem",
            args.out.display()
        );
    }
    Ok(0)
}

/// A host's name (DNS labels of letters, digits and '-') or address: it names the host's
/// files in `--out` too, so nothing that could lead out of it or hide a file.
fn check_name(name: &str) -> Result<()> {
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    };
    if name.parse::<std::net::IpAddr>().is_ok() || (name.len() <= 253 && name.split('.').all(label))
    {
        return Ok(());
    }
    anyhow::bail!(
        "--name '{name}' is not a host name (letters, digits, '-', dots between) or an IP address"
    )
}

/// Creates `path` (never overwrites) with `mode`.
fn write(path: &Path, text: &str, mode: u32) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}
