//! Which connection ("lane") carries a page when a migration's pages travel on several
//! (docs/protocol.md, "Many connections"): a rule of the stream, since a lane's receiver
//! refuses a page of another lane.

/// Most connections one migration may use.
pub const MAX_CONNECTIONS: u32 = 16;
/// Pages of one 2 MiB chunk travel on the same connection (see `lane_of`).
pub const LANE_CHUNK_PAGES: u64 = 512;

/// The connection (0..lanes) that carries page `pfn` when a migration uses `lanes` of them:
/// always the same one, so a page's copies arrive in the order they were sent.
pub fn lane_of(pfn: u64, lanes: u32) -> u32 {
    ((pfn / LANE_CHUNK_PAGES) % u64::from(lanes.max(1))) as u32
}
