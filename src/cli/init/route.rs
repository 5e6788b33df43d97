//! The guarded route `init` writes: `--route` read in either form (the key in a path
//! segment or a query parameter), or `/api/<table>/{key}` by default.

use super::InitError;

/// The guarded route: its path pattern and where the key is in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `/api/products/{key}` or `/api/product/info`.
    pub path: String,
    /// Where the key is.
    pub key: RouteKey,
}

/// Where a request carries the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteKey {
    /// The `{name}` segment of the path.
    Segment(String),
    /// The query parameter of this name.
    Query(String),
}

impl Route {
    /// `/api/items/{key}` (a path segment) or `/api/item?id={key}` (a query parameter).
    pub fn parse(route: &str) -> Result<Route, InitError> {
        let bad = |reason| InitError::BadRoute {
            route: route.to_owned(),
            reason,
        };
        if !route.starts_with('/') {
            return Err(bad("must start with /"));
        }
        if route.contains(['"', '\\', ' ', '#']) {
            return Err(bad("must not contain quotes, backslashes, spaces or #"));
        }
        if let Some((path, query)) = route.split_once('?') {
            let param = query
                .strip_suffix("={key}")
                .filter(|p| !p.is_empty() && !p.contains(['&', '=', '{', '}']))
                .ok_or_else(|| bad("the query must be exactly NAME={key}"))?;
            if path.contains(['{', '}']) {
                return Err(bad(
                    "the key is either in the path or in the query, not both",
                ));
            }
            return Ok(Route {
                path: path.to_owned(),
                key: RouteKey::Query(param.to_owned()),
            });
        }
        let params: Vec<&str> = route
            .split('/')
            .filter(|s| s.contains(['{', '}']))
            .collect();
        match params.as_slice() {
            [seg] => {
                let name = seg
                    .strip_prefix('{')
                    .and_then(|s| s.strip_suffix('}'))
                    .filter(|n| !n.is_empty() && !n.contains(['{', '}']))
                    .ok_or_else(|| bad("a {param} must be a whole path segment"))?;
                Ok(Route {
                    path: route.to_owned(),
                    key: RouteKey::Segment(name.to_owned()),
                })
            }
            [] => Err(bad(
                "needs {key} in a path segment or as NAME={key} in the query",
            )),
            _ => Err(bad("has more than one {param} segment")),
        }
    }

    /// `/api/<table>/{key}`, when the table's name can be a path segment as it is.
    pub fn default_for(table: &str) -> Result<Route, InitError> {
        let plain = !table.is_empty()
            && table
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !plain {
            return Err(InitError::NoDefaultRoute(table.to_owned()));
        }
        Ok(Route {
            path: format!("/api/{table}/{{key}}"),
            key: RouteKey::Segment("key".to_owned()),
        })
    }
}
