//! A scrape of ferry's metrics endpoint (`--metrics`): `GET /metrics`, read by the same HTTP
//! reader as the API, with no body. Fuzzed by `fuzz/fuzz_targets/scrape.rs`.

use std::io::Read;

use crate::error::ApiError;
use crate::server::{HttpRequest, read_request};

/// A request for the exposition.
#[derive(Debug)]
pub struct Scrape {
    /// The client asked for OpenMetrics (its `Accept`), not Prometheus's text format.
    pub openmetrics: bool,
    /// The bearer tokens its `Authorization` headers carry.
    bearers: Vec<String>,
}

impl Scrape {
    /// What `request` asks for: `GET /metrics` and nothing else (404 for another path, 405
    /// for another method).
    pub fn parse(request: &HttpRequest) -> Result<Self, ApiError> {
        match (request.method.as_str(), request.path.as_str()) {
            ("GET", "/metrics") => Ok(Self {
                openmetrics: request.header("accept").any(|a| {
                    a.to_ascii_lowercase()
                        .contains("application/openmetrics-text")
                }),
                bearers: request
                    .header("authorization")
                    .filter_map(|v| v.strip_prefix("Bearer "))
                    .map(|t| t.trim().to_string())
                    .collect(),
            }),
            ("GET", path) => Err(ApiError::new(404, format!("no {path} here: GET /metrics"))),
            _ => Err(ApiError::new(405, "GET /metrics only")),
        }
    }

    /// Whether the request carries `token`, compared in time that does not depend on where
    /// a wrong one differs.
    pub fn carries(&self, token: &str) -> bool {
        self.bearers
            .iter()
            .any(|given| same(given.as_bytes(), token.as_bytes()))
    }
}

/// Reads and parses one scrape from `conn`.
pub fn read_scrape(conn: &mut impl Read) -> Result<Scrape, ApiError> {
    Scrape::parse(&read_request(conn, 0)?)
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(raw: &str) -> Result<Scrape, ApiError> {
        read_scrape(&mut raw.as_bytes())
    }

    #[test]
    fn get_metrics_with_its_accept_and_token() {
        let s = scrape(
            "GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\
             authorization: Bearer s3cret \r\n\r\n",
        )
        .unwrap();
        assert!(s.openmetrics);
        assert!(s.carries("s3cret"));
        assert!(!s.carries("s3cre"));
        let plain = scrape("GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        assert!(!plain.openmetrics && !plain.carries(""));
    }

    #[test]
    fn anything_else_is_refused_by_status() {
        let status = |raw| scrape(raw).unwrap_err().status;
        assert_eq!(status("GET / HTTP/1.1\r\n\r\n"), 404);
        assert_eq!(status("DELETE /metrics HTTP/1.1\r\n\r\n"), 405);
        assert_eq!(status("hello\r\n\r\n"), 400);
        assert_eq!(
            status("GET /metrics HTTP/1.1\r\nContent-Length: 1\r\n\r\nx"),
            413
        );
    }
}
