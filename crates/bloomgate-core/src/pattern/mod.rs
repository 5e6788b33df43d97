//! What the config compiles requests against, shared by the config and the stages that
//! serve: canonical request paths (`path`), route patterns and query rules (`route`),
//! and address ranges (`cidrs`). Nothing here knows of a request's handling.

pub mod cidrs;
pub mod path;
pub mod route;
