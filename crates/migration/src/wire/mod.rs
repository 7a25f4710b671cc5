//! The format of what crosses the wire: framing and messages, page frames and their
//! encodings. Both sides use this module; neither side uses the other.

pub mod codec;
pub mod delta;
pub mod frame;
pub mod lanes;
pub mod message;
pub mod page_frame;

pub use frame::{
    Frame, read_frame, read_message, read_stream_header, write_message, write_stream_header,
};
pub use message::{Message, PostcopyReport, StreamMode};
