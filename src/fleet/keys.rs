//! The names of every Redis key a fleet uses, under its namespace `ns`. Each starts
//! with the hash tag `{ns}`, so all of them are in one hash slot of a Redis Cluster:
//! the scripts that take a lease, publish a generation or append to the stream touch
//! several of them at once, and Cluster runs a script only on keys of one slot.
//!
//! | key | type | holds |
//! |---|---|---|
//! | `{ns}:epoch` | string | a random token set by the first instance to find it absent; a different one means Redis lost its data |
//! | `{ns}:stream` | stream | the change stream (admissions, invalidations, generation announcements) |
//! | `{ns}:filter:F:lease` | string, expiring | `epoch:instance` of filter F's builder |
//! | `{ns}:filter:F:fence` | integer | the fencing epoch counter of F's lease |
//! | `{ns}:filter:F:gen_seq` | integer | the last generation number drawn for F |
//! | `{ns}:filter:F:current` | hash | the current generation of F (`gen`, `chunks`, `bytes`, `items`, `start`, `by`, `at`) |
//! | `{ns}:filter:F:gen:G:I` | string | chunk I of generation G of F; expiring once superseded |

/// Key names of one fleet.
#[derive(Debug, Clone)]
pub struct Keys {
    ns: String,
}

impl Keys {
    /// Keys under namespace `ns`.
    pub fn new(ns: &str) -> Keys {
        Keys {
            ns: format!("{{{ns}}}"),
        }
    }

    /// The epoch token.
    pub fn epoch(&self) -> String {
        format!("{}:epoch", self.ns)
    }

    /// The change stream.
    pub fn stream(&self) -> String {
        format!("{}:stream", self.ns)
    }

    /// Filter `f`'s builder lease.
    pub fn lease(&self, f: &str) -> String {
        format!("{}:filter:{f}:lease", self.ns)
    }

    /// Filter `f`'s fencing epoch counter.
    pub fn fence(&self, f: &str) -> String {
        format!("{}:filter:{f}:fence", self.ns)
    }

    /// Filter `f`'s generation counter.
    pub fn generation_seq(&self, f: &str) -> String {
        format!("{}:filter:{f}:gen_seq", self.ns)
    }

    /// Filter `f`'s current generation record.
    pub fn current(&self, f: &str) -> String {
        format!("{}:filter:{f}:current", self.ns)
    }

    /// What chunk names of filter `f` start with (followed by `G:I`).
    pub fn chunk_prefix(&self, f: &str) -> String {
        format!("{}:filter:{f}:gen:", self.ns)
    }

    /// Chunk `i` of generation `g` of filter `f`.
    pub fn chunk(&self, f: &str, g: u64, i: u64) -> String {
        format!("{}{g}:{i}", self.chunk_prefix(f))
    }
}
