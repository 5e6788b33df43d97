//! How an error is printed for a person or a log line: the error and every cause below
//! it, `: `-separated, as in `redis: broken pipe`.
//!
//! The crate's errors say what failed and carry the reason as their source, so their own
//! message never repeats it; whatever prints one for a reader goes through [`Chain`].
//! Errors from other crates sometimes repeat their source in their message as well: a
//! cause whose text the error above it already shows is not printed again.

use std::error::Error;
use std::fmt;

/// Displays an error followed by each of its sources, `: `-separated:
/// `tracing::warn!(error = %Chain(&e), ...)`, `eprintln!("{}", Chain(&e))`.
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut above = self.0.to_string();
        f.write_str(&above)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !above.contains(&text) {
                f.write_str(": ")?;
                f.write_str(&text)?;
            }
            above = text;
            cause = c.source();
        }
        Ok(())
    }
}

impl fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a message and, maybe, a cause.
    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<dyn Error + 'static>>);

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl Error for Layer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref()
        }
    }

    fn layer(message: &'static str, cause: Layer) -> Layer {
        Layer(message, Some(Box::new(cause)))
    }

    #[test]
    fn an_error_without_a_source_prints_alone() {
        let e = Layer("the builder lease was lost", None);
        assert_eq!(Chain(&e).to_string(), "the builder lease was lost");
    }

    #[test]
    fn two_levels_print_the_cause_after_the_error() {
        let e = layer("redis", Layer("broken pipe", None));
        assert_eq!(Chain(&e).to_string(), "redis: broken pipe");
    }

    #[test]
    fn three_levels_print_every_cause_in_order() {
        let e = layer(
            "source query failed",
            layer("database unavailable", Layer("connection refused", None)),
        );
        assert_eq!(
            Chain(&e).to_string(),
            "source query failed: database unavailable: connection refused"
        );
    }

    #[test]
    fn a_cause_the_error_above_already_shows_is_not_repeated() {
        let io = std::io::Error::other("connection reset");
        let e = layer(
            "redis",
            Layer("error communicating: connection reset", Some(Box::new(io))),
        );
        assert_eq!(
            Chain(&e).to_string(),
            "redis: error communicating: connection reset"
        );
    }

    #[test]
    fn debug_prints_the_chain_too() {
        let e = layer("redis", Layer("broken pipe", None));
        assert_eq!(format!("{:?}", Chain(&e)), "redis: broken pipe");
    }
}
