//! The gate's answer for one key: the local copy's verdict and, for a filter held in
//! Redis, what Redis says when the local copy refuses the key or has nothing loaded.
//! The request handler asks for it in one call and never sees where the answer came
//! from; the copy held in Redis itself is `held`'s.

use super::{Filter, Verdict};

impl Filter {
    /// The verdict for a key's canonical bytes. A filter held only in memory answers at
    /// once, with no lock and no allocation; one held in Redis asks Redis only when the
    /// local copy does not say [`Verdict::MaybePresent`] (see [`Filter::ask_held`]).
    pub async fn verdict(&self, key: &[u8]) -> Verdict {
        let local = self.check(key);
        match self.held() {
            // Boxed: only refusals of a filter held in Redis wait on it, and every other
            // request's future should not carry that state.
            Some(held) if local != Verdict::MaybePresent => {
                Box::pin(self.ask_held(held, key, local)).await
            }
            _ => local,
        }
    }

    /// [`Filter::verdict`] when it needs no waiting: the local copy's verdict, unless the
    /// filter is held in Redis and Redis would be asked (`None`).
    pub fn verdict_now(&self, key: &[u8]) -> Option<Verdict> {
        let local = self.check(key);
        if local != Verdict::MaybePresent && self.held().is_some() {
            return None;
        }
        Some(local)
    }
}
