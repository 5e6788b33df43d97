//! The admin plane's endpoints: each one's method and path, the one list the router
//! dispatches on and docs/admin-api.md is checked against. It does not serve them (see
//! `admin`).

use http::Method;

/// One admin endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `GET /metrics`: Prometheus text format.
    Metrics,
    /// `GET /healthz`: the process is up.
    Healthz,
    /// `GET /readyz`: every filter is loaded.
    Readyz,
    /// `GET /admin/filters`: each filter's state.
    Filters,
    /// `GET /admin/origins`: each origin's breaker and lookup slots.
    Origins,
    /// `GET /admin/fleet`: fleet mode's roles and generations.
    Fleet,
    /// `POST /admin/filters/{name}/rebuild`.
    Rebuild,
    /// `POST /admin/filters/{name}/keys`: admits keys.
    AddKeys,
    /// `POST /admin/cache/invalidate`: drops cached entries.
    Invalidate,
    /// `POST /admin/reload`: reads the configuration file again.
    Reload,
}

impl Endpoint {
    /// Every endpoint the admin plane serves.
    pub const ALL: [Endpoint; 10] = [
        Endpoint::Metrics,
        Endpoint::Healthz,
        Endpoint::Readyz,
        Endpoint::Filters,
        Endpoint::Origins,
        Endpoint::Fleet,
        Endpoint::Rebuild,
        Endpoint::AddKeys,
        Endpoint::Invalidate,
        Endpoint::Reload,
    ];

    /// The method it answers.
    pub fn method(self) -> Method {
        if self.mutates() {
            Method::POST
        } else {
            Method::GET
        }
    }

    /// Its path; `{name}` stands for a filter's name.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Metrics => "/metrics",
            Endpoint::Healthz => "/healthz",
            Endpoint::Readyz => "/readyz",
            Endpoint::Filters => "/admin/filters",
            Endpoint::Origins => "/admin/origins",
            Endpoint::Fleet => "/admin/fleet",
            Endpoint::Rebuild => "/admin/filters/{name}/rebuild",
            Endpoint::AddKeys => "/admin/filters/{name}/keys",
            Endpoint::Invalidate => "/admin/cache/invalidate",
            Endpoint::Reload => "/admin/reload",
        }
    }

    /// Whether it changes something, and so needs the bearer token.
    pub fn mutates(self) -> bool {
        matches!(
            self,
            Endpoint::Rebuild | Endpoint::AddKeys | Endpoint::Invalidate | Endpoint::Reload
        )
    }

    /// The endpoint whose path `path` is (slashes around it ignored), with the filter
    /// name it holds, if any. The method is the caller's to check.
    pub fn find(path: &str) -> Option<(Endpoint, Option<&str>)> {
        let asked: Vec<&str> = path.trim_matches('/').split('/').collect();
        Endpoint::ALL.into_iter().find_map(|endpoint| {
            let pattern: Vec<&str> = endpoint.path().trim_matches('/').split('/').collect();
            if pattern.len() != asked.len() {
                return None;
            }
            let mut name = None;
            for (want, got) in pattern.iter().zip(&asked) {
                if *want == "{name}" {
                    name = Some(*got);
                } else if want != got {
                    return None;
                }
            }
            Some((endpoint, name))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_find_their_endpoint_and_name() {
        for endpoint in Endpoint::ALL {
            let path = endpoint.path().replace("{name}", "products");
            let name = endpoint.path().contains("{name}").then_some("products");
            assert_eq!(Endpoint::find(&path), Some((endpoint, name)), "{path}");
        }
        assert_eq!(Endpoint::find("/metrics/"), Some((Endpoint::Metrics, None)));
        assert_eq!(Endpoint::find("/admin/filters/products/drop"), None);
        assert_eq!(Endpoint::find("/admin"), None);
    }
}
