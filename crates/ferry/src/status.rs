//! Commands that talk to a running ferry through its API.

use std::io::Write;

use anyhow::Result;
use api::ApiClient;

use crate::cli::{ApiArgs, BalloonArgs, MigrateResumeArgs, TakeBackArgs};

pub fn status(args: &ApiArgs) -> Result<i32> {
    let info = ApiClient::new(&args.api_socket).get("vm.info")?;
    let text = serde_json::to_string_pretty(&info)?;
    match writeln!(std::io::stdout().lock(), "{text}") {
        // A reader that stops early (`ferry status | head`) is no failure of ours.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        r => r.map(|()| 0).map_err(Into::into),
    }
}

pub fn simple_put(args: &ApiArgs, endpoint: &str) -> Result<i32> {
    ApiClient::new(&args.api_socket).put(endpoint, None)?;
    Ok(0)
}

/// `vm.migrate-start-postcopy`, saying when it acts.
pub fn start_postcopy(args: &ApiArgs) -> Result<i32> {
    ApiClient::new(&args.api_socket).put("vm.migrate-start-postcopy", None)?;
    println!(
        "switching to post-copy: the round being sent stops where it is (`ferry migration \
         --watch` follows)"
    );
    Ok(0)
}

/// `vm.migrate-reclaim` or `vm.migrate-rollback`, saying where the VM runs from.
pub fn take_back(args: &TakeBackArgs, endpoint: &str) -> Result<i32> {
    let body = serde_json::to_value(api::TakeBackRequest { force: args.force })?;
    let said = ApiClient::new(&args.api_socket).put(endpoint, Some(&body))?;
    match said.get("checkpoint").and_then(|c| c.as_u64()) {
        Some(seq) => println!("the VM runs here again from post-copy checkpoint {seq}"),
        None => println!("the VM runs here again from the switch"),
    }
    Ok(0)
}

/// `vm.balloon`: sets the balloon's target.
pub fn balloon(args: &BalloonArgs) -> Result<i32> {
    let body = api::BalloonRequest {
        target_mib: Some(args.target_mib),
        target_pages: None,
    };
    ApiClient::new(&args.api_socket).put("vm.balloon", Some(&serde_json::to_value(body)?))?;
    Ok(0)
}

pub fn migrate_resume(args: &MigrateResumeArgs) -> Result<i32> {
    let body = api::MigrateResumeRequest {
        listen: args.listen.clone(),
        destination: args.to.clone(),
        timeout_s: args.timeout_s,
    };
    ApiClient::new(&args.api_socket)
        .put("vm.migrate-resume", Some(&serde_json::to_value(body)?))?;
    Ok(0)
}
