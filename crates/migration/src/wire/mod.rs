//! Everything that crosses the wire: framing and messages, page frames, page bitmaps, the zero
//! check, and the transports. Both sides use this module; neither side uses the other.

pub mod bitmap;
pub mod codec;
pub mod delta;
pub mod frame;
pub mod gate;
pub mod lanefile;
pub mod message;
pub(crate) mod packers;
pub mod pages;
pub mod tls;
pub mod transport;
pub mod zero;

pub use frame::{
    Frame, read_frame, read_message, read_stream_header, write_message, write_stream_header,
};
pub use message::{Message, PostcopyReport, StreamMode};
