//! Socket helpers that ferry's migration engine and its API server both use, and nothing
//! else: reads and writes held to one deadline for a whole exchange (`deadline`), and Unix
//! socket files only their owner can connect to (`unix`), TCP from a chosen address (`tcp`), files passed with a request (`passed`). A crate of its own so that the API
//! needs none of the engine.

pub mod deadline;
pub mod passed;
pub mod tcp;
pub mod unix;
