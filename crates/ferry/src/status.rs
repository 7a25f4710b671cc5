//! Commands that talk to a running ferry through its API.

use anyhow::Result;
use api::ApiClient;

use crate::cli::{ApiArgs, MigrateResumeArgs};

pub fn status(args: &ApiArgs) -> Result<i32> {
    let info = ApiClient::new(&args.api_socket).get("vm.info")?;
    println!("{}", serde_json::to_string_pretty(&info)?);
    Ok(0)
}

pub fn simple_put(args: &ApiArgs, endpoint: &str) -> Result<i32> {
    ApiClient::new(&args.api_socket).put(endpoint, None)?;
    Ok(0)
}

pub fn migrate_resume(args: &MigrateResumeArgs) -> Result<i32> {
    let body = api::MigrateResumeRequest {
        listen: args.listen.clone(),
        destination: args.to.clone(),
    };
    ApiClient::new(&args.api_socket)
        .put("vm.migrate-resume", Some(&serde_json::to_value(body)?))?;
    Ok(0)
}
