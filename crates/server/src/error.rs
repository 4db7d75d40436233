//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::extract::rejection::BytesRejection;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use std::borrow::Cow;

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, and where.
    pub message: String,
    /// OpenAI's error type.
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<Cow<'static, str>>,
    /// A machine-readable code.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(Cow::Borrowed),
            code: None,
        }
    }

    /// 400 `invalid_request_error` about the request field `param` (a name from the body).
    pub fn bad_field(message: impl Into<String>, param: &str) -> ApiError {
        ApiError { param: Some(Cow::Owned(param.to_string())), ..ApiError::bad(message, None) }
    }

    /// 401: a missing or wrong API key.
    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "invalid API key: send `Authorization: Bearer <key>`".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 404: a model this server does not serve.
    pub fn unknown_model(name: &str, served: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{name}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some(Cow::Borrowed("model")),
            code: Some("model_not_found"),
        }
    }

    /// 404 for a path no route serves, 405 for a method its route does not take: OpenAI's
    /// `Invalid URL (METHOD PATH)`.
    pub fn no_route(status: StatusCode, method: &Method, uri: &Uri) -> ApiError {
        let why = if status == StatusCode::METHOD_NOT_ALLOWED { "; this route takes another method" } else { "" };
        ApiError { status, ..ApiError::bad(format!("Invalid URL ({method} {}){why}", uri.path()), None) }
    }

    /// 500: the server failed.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 503: the server is shutting down.
    pub fn unavailable() -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down".into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// The request fields the engine's validation messages name, the first one a message
/// contains being the field at fault.
const PARAMS: [&str; 11] = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "logprobs",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "prompt",
];

/// A body that could not be read (too large, or the connection failed), with axum's status.
impl From<BytesRejection> for ApiError {
    fn from(e: BytesRejection) -> ApiError {
        ApiError { status: e.status(), ..ApiError::bad(format!("reading the request body: {}", e.body_text()), None) }
    }
}

impl From<runtime::RuntimeError> for ApiError {
    fn from(e: runtime::RuntimeError) -> ApiError {
        match e {
            runtime::RuntimeError::Invalid(m) => {
                let param = PARAMS
                    .into_iter()
                    .find(|p| m.starts_with(p))
                    .or_else(|| PARAMS.into_iter().find(|p| m.contains(p)));
                ApiError::bad(m, param)
            }
            other => ApiError::internal(other.to_string()),
        }
    }
}
