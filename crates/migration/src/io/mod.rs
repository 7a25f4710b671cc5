//! How a migration's bytes travel: endpoints, connections and listeners (`transport`), TLS
//! (`tls`), the destination's gate that opens connections off its main thread (`gate`), and
//! snapshot files with a lane per connection (`lanefile`). What the bytes mean is `wire`.

pub mod gate;
pub mod lanefile;
pub mod tls;
pub mod transport;
