//! Scraping an OpenMetrics endpoint in tests: every scrape is checked by `promtool`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};

/// One scrape of the endpoint at `socket`: the body, after checking the answer's head.
pub fn scrape(socket: &Path) -> String {
    let mut conn = UnixStream::connect(socket).expect("connect to the metrics socket");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: ferry\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    check_with_promtool(body);
    body.to_string()
}

/// `promtool check metrics` must accept the exposition (CI installs promtool; elsewhere a
/// missing promtool is said, not taken for a pass).
pub fn check_with_promtool(body: &str) {
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        assert!(
            std::env::var_os("CI").is_none(),
            "promtool is missing (scripts/install-deps.sh installs it)"
        );
        eprintln!("promtool missing: the exposition was not checked by it");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{body}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The value of `series` (a name with its labels, as the exposition writes them).
pub fn value(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

pub fn must(body: &str, series: &str) -> f64 {
    value(body, series).unwrap_or_else(|| panic!("no {series} in\n{body}"))
}
