//! Every refusal the admin plane answers: its stable code and HTTP status, the one list
//! each admin error response is built from and docs/admin-api.md is checked against.

use http::StatusCode;

/// Why an admin call was refused; the `error` field of the JSON body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// No admin endpoint has this path.
    NotFound,
    /// The path is an endpoint's, the method is not.
    MethodNotAllowed,
    /// No `Authorization: Bearer` header, or the wrong token.
    Unauthorized,
    /// No `admin.token` is configured, so mutating calls are off.
    AdminDisabled,
    /// The filter named in the path is not configured.
    NoSuchFilter,
    /// `GET /admin/fleet` without a `[fleet]` section.
    FleetOff,
    /// A follower could not send a rebuild request on through Redis.
    FleetUnreachable,
    /// A key list over the body limit, or a body that could not be read.
    BodyTooLarge,
    /// A body that is not UTF-8.
    BadBody,
    /// A body that starts like a JSON array and is not one.
    BadJson,
    /// A JSON array holding something other than strings and numbers.
    BadKey,
    /// A reload of a configuration given in-process, with no file to read.
    NoConfigFile,
    /// A reload of a file that cannot be read or breaks a rule.
    ConfigInvalid,
    /// A reload of a file that changes a setting only a restart applies.
    NeedsRestart,
    /// A reload whose new pipeline could not be assembled.
    ReloadFailed,
    /// The metrics could not be encoded.
    InternalError,
}

impl ErrorCode {
    /// Every code the admin plane answers.
    pub const ALL: [ErrorCode; 16] = [
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::Unauthorized,
        ErrorCode::AdminDisabled,
        ErrorCode::NoSuchFilter,
        ErrorCode::FleetOff,
        ErrorCode::FleetUnreachable,
        ErrorCode::BodyTooLarge,
        ErrorCode::BadBody,
        ErrorCode::BadJson,
        ErrorCode::BadKey,
        ErrorCode::NoConfigFile,
        ErrorCode::ConfigInvalid,
        ErrorCode::NeedsRestart,
        ErrorCode::ReloadFailed,
        ErrorCode::InternalError,
    ];

    /// The code as the JSON body spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::AdminDisabled => "admin_disabled",
            ErrorCode::NoSuchFilter => "no_such_filter",
            ErrorCode::FleetOff => "fleet_off",
            ErrorCode::FleetUnreachable => "fleet_unreachable",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::BadBody => "bad_body",
            ErrorCode::BadJson => "bad_json",
            ErrorCode::BadKey => "bad_key",
            ErrorCode::NoConfigFile => "no_config_file",
            ErrorCode::ConfigInvalid => "config_invalid",
            ErrorCode::NeedsRestart => "needs_restart",
            ErrorCode::ReloadFailed => "reload_failed",
            ErrorCode::InternalError => "internal_error",
        }
    }

    /// The status it is answered with.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::NotFound | ErrorCode::NoSuchFilter | ErrorCode::FleetOff => {
                StatusCode::NOT_FOUND
            }
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::AdminDisabled => StatusCode::FORBIDDEN,
            ErrorCode::FleetUnreachable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::BadBody | ErrorCode::BadJson | ErrorCode::BadKey => StatusCode::BAD_REQUEST,
            ErrorCode::NoConfigFile | ErrorCode::NeedsRestart => StatusCode::CONFLICT,
            ErrorCode::ConfigInvalid => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::ReloadFailed | ErrorCode::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}
