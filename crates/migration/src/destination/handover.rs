//! The one moment an arriving VM becomes this host's. Before it, a stop request (the API's
//! shutdown, a signal) aborts the arrival and the source, told why, runs the VM on. From it
//! on the VM runs here, and a stop request that came too late is refused: a VM is never
//! handed over and then stopped by a request made before anyone could know it was here.

use crate::sync::Locked;
use std::sync::Mutex;

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Gate {
    Open,
    /// Asked to stop, by whom.
    Stopped(String),
    /// The VM runs here (or is about to, with nothing left that may fail).
    Committed,
}

/// Decides, under one lock, whether a stop request or the VM's start comes first.
pub struct Handover(Mutex<Gate>);

impl Default for Handover {
    fn default() -> Self {
        Self(Mutex::new(Gate::Open))
    }
}

impl Handover {
    fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.0.locked()
    }

    /// A stop request from `who`: stops the arrival unless the VM already runs here.
    pub fn stop(&self, who: &str) -> Result<()> {
        let mut gate = self.gate();
        match &*gate {
            Gate::Committed => Err(Error::State(format!(
                "the VM was handed over to this host as {who} came: it runs here now; ask \
                 again to stop it"
            ))),
            Gate::Stopped(_) => Ok(()),
            Gate::Open => {
                *gate = Gate::Stopped(who.to_string());
                Ok(())
            }
        }
    }

    /// Whether a stop request came (and the arrival must end).
    pub fn stopped(&self) -> bool {
        matches!(*self.gate(), Gate::Stopped(_))
    }

    /// Fails with who asked to stop, if someone did.
    pub(crate) fn check(&self) -> Result<()> {
        match &*self.gate() {
            Gate::Stopped(who) => Err(Error::Stopped(who.clone())),
            _ => Ok(()),
        }
    }

    /// The VM is about to run here: from now on no stop request ends the arrival. `signal`
    /// names a stop asked for by a signal, which a handler cannot take this lock for.
    pub(crate) fn commit(&self, signal: Option<&str>) -> Result<()> {
        let mut gate = self.gate();
        if let Some(who) = signal {
            *gate = Gate::Stopped(who.to_string());
        }
        if let Gate::Stopped(who) = &*gate {
            return Err(Error::Stopped(who.clone()));
        }
        *gate = Gate::Committed;
        Ok(())
    }

    /// Whether the VM was committed to run here (errors after that must not give it up).
    pub(crate) fn committed(&self) -> bool {
        *self.gate() == Gate::Committed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_before_the_commit_wins_and_one_after_it_is_refused() {
        let h = Handover::default();
        h.stop("vm.shutdown").unwrap();
        assert!(h.stopped());
        assert!(matches!(h.check(), Err(Error::Stopped(w)) if w == "vm.shutdown"));
        assert!(matches!(h.commit(None), Err(Error::Stopped(_))));
        assert!(!h.committed());

        let h = Handover::default();
        h.check().unwrap();
        h.commit(None).unwrap();
        assert!(h.committed());
        let e = h.stop("vm.shutdown").unwrap_err();
        assert!(e.to_string().contains("runs here now"), "{e}");
        assert!(!h.stopped());
    }

    #[test]
    fn a_signal_seen_at_the_commit_stops_the_arrival() {
        let h = Handover::default();
        assert!(matches!(h.commit(Some("SIGTERM")), Err(Error::Stopped(w)) if w == "SIGTERM"));
        assert!(h.stopped());
    }
}
