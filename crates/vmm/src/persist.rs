//! State that moves with a VM, component by component (Firecracker's `Persist` beside each
//! device, crosvm's named snapshot fragments): each component saves a typed state under a name
//! and the version of its own encoding, so that a component added, or one whose state changes,
//! moves no other's version.
//!
//! A VM's device state is a list of fragments (`irqchip`, `pit`, `clock`, `serial`,
//! `heartbeat`, `virtio.0` …), each vCPU's state one fragment (`vcpu`). A virtio device's
//! fragment holds its transport's registers and, as a fragment of its own, the device's state
//! (named and versioned by its type: `virtio-blk`, `virtio-net`, `virtio-balloon`).

use bincode::Options;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

/// One component's state as it travels.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fragment {
    /// Which component it is (`serial`, `virtio.0`).
    pub name: String,
    /// The version of the encoding in `bytes` (the component's `Persist::VERSION`).
    pub version: u32,
    pub bytes: Vec<u8>,
}

/// A component whose state moves with the VM. Its version constant lives beside its code.
pub trait Persist {
    /// What its kind is called (a fragment takes the name of the component it holds, which
    /// for a kind a VM has one of is this).
    const NAME: &'static str;
    /// Version of `State`'s encoding; bump on any change to it.
    const VERSION: u32;
    type State: Serialize + DeserializeOwned;
    fn save(&self) -> Result<Self::State, String>;
    /// Takes over a state another host's component of this kind saved.
    fn load(&mut self, state: Self::State) -> Result<(), String>;
}

/// `Persist` behind a `dyn`: what a loop over a VM's components calls.
pub trait Component {
    /// `Persist::NAME`.
    fn kind(&self) -> &'static str;
    /// Its state, as the fragment `name`.
    fn save_as(&self, name: &str) -> Result<Fragment, String>;
    /// Loads `fragment`, refused when it is of another version than this ferry reads.
    fn load_from(&mut self, fragment: &Fragment) -> Result<(), String>;
}

impl<P: Persist> Component for P {
    fn kind(&self) -> &'static str {
        P::NAME
    }

    fn save_as(&self, name: &str) -> Result<Fragment, String> {
        fragment::<P>(name, &self.save()?)
    }

    fn load_from(&mut self, f: &Fragment) -> Result<(), String> {
        let what = match f.name == P::NAME {
            true => f.name.clone(),
            false => format!("{} ({})", f.name, P::NAME),
        };
        if f.version != P::VERSION {
            return Err(format!(
                "{what} has state version {}, this ferry reads version {}",
                f.version,
                P::VERSION
            ));
        }
        let state = from_bytes(&f.bytes).map_err(|e| format!("undecodable {what} state: {e}"))?;
        self.load(state).map_err(|e| format!("{}: {e}", f.name))
    }
}

/// `state`, a state of `P`'s kind, as the fragment `name`.
pub fn fragment<P: Persist>(name: &str, state: &P::State) -> Result<Fragment, String> {
    Ok(Fragment {
        name: name.into(),
        version: P::VERSION,
        bytes: to_bytes(state).map_err(|e| format!("{name}: {e}"))?,
    })
}

/// A VM's device state: a fragment per component.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fragments(pub Vec<Fragment>);

impl Fragments {
    /// Checks that the fragments are those of the components `names`, each once: refuses a
    /// duplicate, one no component here takes, and one missing, naming it.
    pub fn check(&self, names: &[String]) -> Result<(), String> {
        for (i, f) in self.0.iter().enumerate() {
            if self.0[..i].iter().any(|g| g.name == f.name) {
                return Err(format!("the state holds fragment {} twice", f.name));
            }
            if !names.contains(&f.name) {
                return Err(format!(
                    "the state holds fragment {}, which no component of this VM takes (it has {})",
                    f.name,
                    names.join(", ")
                ));
            }
        }
        match names.iter().find(|n| self.get(n).is_none()) {
            Some(missing) => Err(format!("the state has no fragment {missing}")),
            None => Ok(()),
        }
    }

    pub fn get(&self, name: &str) -> Option<&Fragment> {
        self.0.iter().find(|f| f.name == name)
    }
}

/// bincode as `bincode::serialize` writes it (fixed-width integers, little-endian), read back
/// refusing bytes left over.
fn options() -> impl Options {
    bincode::DefaultOptions::new().with_fixint_encoding()
}

pub fn to_bytes<T: Serialize>(value: &T) -> Result<Vec<u8>, String> {
    options()
        .serialize(value)
        .map_err(|e| format!("cannot encode: {e}"))
}

pub fn from_bytes<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    options().deserialize(bytes).map_err(|e| e.to_string())
}

/// The test every component passes: its state saved, loaded into a fresh twin and saved
/// again encodes the same.
#[cfg(test)]
pub fn assert_round_trip(from: &dyn Component, twin: &mut dyn Component) {
    let saved = from.save_as(from.kind()).unwrap();
    let before = twin.save_as(from.kind()).unwrap();
    assert_ne!(
        saved,
        before,
        "{}: a twin that already holds it proves nothing",
        from.kind()
    );
    twin.load_from(&saved)
        .unwrap_or_else(|e| panic!("{} does not load its own state: {e}", from.kind()));
    let again = twin.save_as(from.kind()).unwrap();
    assert_eq!(saved, again, "{} saved, loaded, saved", from.kind());
}

/// `assert_round_trip` for a component whose state holds what the host stamps as it loads
/// it (a time): `stamped` clears that from each state before they are compared.
#[cfg(test)]
pub fn assert_round_trip_but<P: Persist>(from: &P, twin: &mut P, stamped: fn(&mut P::State)) {
    let unstamped = |p: &P| {
        let mut state = p.save().unwrap();
        stamped(&mut state);
        to_bytes(&state).unwrap()
    };
    let saved = unstamped(from);
    assert_ne!(
        saved,
        unstamped(twin),
        "{}: the twin holds it already",
        P::NAME
    );
    twin.load(from.save().unwrap()).unwrap();
    assert_eq!(saved, unstamped(twin), "{} saved, loaded, saved", P::NAME);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A component with a state of two numbers, version 2.
    #[derive(Default)]
    struct Dial(u32, u64);

    impl Persist for Dial {
        const NAME: &'static str = "dial";
        const VERSION: u32 = 2;
        type State = (u32, u64);
        fn save(&self) -> Result<(u32, u64), String> {
            Ok((self.0, self.1))
        }
        fn load(&mut self, (a, b): (u32, u64)) -> Result<(), String> {
            if a == 0 {
                return Err("a dial at 0".into());
            }
            *self = Dial(a, b);
            Ok(())
        }
    }

    #[test]
    fn a_component_round_trips_and_refuses_another_version_naming_both() {
        assert_round_trip(&Dial(3, 4), &mut Dial::default());
        let mut f = Dial(3, 4).save_as("dial.1").unwrap();
        assert_eq!((f.name.as_str(), f.version), ("dial.1", 2));
        f.version = 7;
        let e = Dial::default().load_from(&f).unwrap_err();
        assert!(
            e.contains("dial.1 (dial) has state version 7, this ferry reads version 2"),
            "{e}"
        );
    }

    #[test]
    fn undecodable_or_refused_state_names_its_fragment() {
        let mut f = Dial(3, 4).save_as("dial.1").unwrap();
        f.bytes.push(0);
        let e = Dial::default().load_from(&f).unwrap_err();
        assert!(e.contains("undecodable dial.1 (dial) state"), "{e}");
        f.bytes.truncate(5);
        let e = Dial::default().load_from(&f).unwrap_err();
        assert!(e.contains("undecodable dial.1"), "{e}");
        let f = Dial(0, 4).save_as("dial.1").unwrap();
        let e = Dial::default().load_from(&f).unwrap_err();
        assert_eq!(e, "dial.1: a dial at 0");
    }

    #[test]
    fn fragments_missing_unknown_or_twice_are_refused_by_name() {
        let names = ["serial".to_string(), "virtio.0".to_string()];
        let frag = |name: &str| Dial(1, 1).save_as(name).unwrap();
        let all = Fragments(vec![frag("virtio.0"), frag("serial")]);
        assert_eq!(all.check(&names), Ok(()), "in any order");
        let e = Fragments(vec![frag("serial")]).check(&names).unwrap_err();
        assert_eq!(e, "the state has no fragment virtio.0");
        let e = Fragments(vec![frag("serial"), frag("virtio.0"), frag("virtio.1")])
            .check(&names)
            .unwrap_err();
        assert!(
            e.contains("fragment virtio.1, which no component of this VM takes"),
            "{e}"
        );
        let e = Fragments(vec![frag("serial"), frag("serial"), frag("virtio.0")])
            .check(&names)
            .unwrap_err();
        assert_eq!(e, "the state holds fragment serial twice");
    }
}
