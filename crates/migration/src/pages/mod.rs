//! The page pipeline: the sender batches pages into frames, compressed, as deltas or straight
//! from guest memory, and the receiver puts each frame's pages into guest memory. What the
//! frames look like on the wire is `wire::page_frame`.
//!
//! Files by job: `sender` and `receiver`; `in_place` (frames straight between guest memory and
//! the socket); `packers` (threads that compress a sender's frames); `deltas` (the copies a
//! sender sent last, for delta encoding); `policy` (`auto`'s choice of a codec for each frame)
//! and `auto` (what it learns from beside the frames).

mod auto;
mod blocks;
pub mod deltas;
mod in_place;
mod packers;
pub mod policy;
mod receiver;
mod sender;
#[cfg(test)]
mod tests;

pub use blocks::BlockPacker;
pub use receiver::{PagePlacer, PageReceiver};
pub use sender::{PageSender, SendCounters};
