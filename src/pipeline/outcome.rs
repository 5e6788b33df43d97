//! How a guarded request ended. One enum names it for the metric label, the log field and
//! the `x-bloomgate` response header, so the three can never disagree. No logic lives here.

/// The end of a request on a guarded route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The gate said "definitely absent": 404 with no cache or origin work.
    Intercepted,
    /// Answered from a positive cache entry (or from a load another request was making).
    CacheHit,
    /// Answered 404 from a negative entry: a known false positive of the gate.
    NegativeHit,
    /// The origin found the key; the answer is now cached.
    OriginFound,
    /// The gate let an absent key through and the origin said "not found".
    FalsePositive,
    /// The gate was unavailable (not loaded yet); the request went to cache and origin.
    FailOpen,
    /// The request failed: malformed key, origin timeout, database unavailable, …
    Error,
    /// Shadow mode: the gate called the key absent, but the request was served anyway.
    WouldIntercept,
    /// 429: the client used up its false-positive budget and the request needed the
    /// origin.
    Throttled,
    /// Answered from a positive entry past its TTL: the origin failed (or its breaker is
    /// open) within `stale_if_error`, or a background refresh runs within
    /// `stale_while_revalidate`.
    Stale,
}

impl Outcome {
    /// Every outcome, in label order (metric handles are resolved once per outcome).
    pub const ALL: [Outcome; 10] = [
        Outcome::Intercepted,
        Outcome::CacheHit,
        Outcome::NegativeHit,
        Outcome::OriginFound,
        Outcome::FalsePositive,
        Outcome::FailOpen,
        Outcome::Error,
        Outcome::WouldIntercept,
        Outcome::Throttled,
        Outcome::Stale,
    ];

    /// The `outcome` metric label and log field.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Intercepted => "intercepted",
            Outcome::CacheHit => "cache_hit",
            Outcome::NegativeHit => "negative_hit",
            Outcome::OriginFound => "origin_found",
            Outcome::FalsePositive => "false_positive",
            Outcome::FailOpen => "fail_open",
            Outcome::Error => "error",
            Outcome::WouldIntercept => "would_intercept",
            Outcome::Throttled => "throttled",
            Outcome::Stale => "stale",
        }
    }

    /// The `x-bloomgate` header value.
    pub fn header_value(self) -> &'static str {
        match self {
            Outcome::Intercepted => "intercepted",
            Outcome::CacheHit => "hit",
            Outcome::NegativeHit => "negative-hit",
            Outcome::OriginFound | Outcome::FalsePositive => "miss",
            Outcome::FailOpen => "fail-open",
            Outcome::Error => "error",
            // Never the served stage: shadow requests carry the stage that answered them.
            Outcome::WouldIntercept => "miss",
            Outcome::Throttled => "throttled",
            Outcome::Stale => "stale",
        }
    }

    /// Position in [`Outcome::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The `x-bloomgate` value on routes that are not guarded.
pub const BYPASS: &str = "bypass";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_matches_all() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i);
        }
    }
}
