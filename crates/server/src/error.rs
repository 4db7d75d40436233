//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

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
    pub param: Option<&'static str>,
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
            param,
            code: None,
        }
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
            param: Some("model"),
            code: Some("model_not_found"),
        }
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

impl From<runtime::RuntimeError> for ApiError {
    fn from(e: runtime::RuntimeError) -> ApiError {
        match e {
            runtime::RuntimeError::Invalid(m) => {
                let param = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs", "penalty", "prompt"]
                    .into_iter()
                    .find(|p| m.contains(p));
                let param = param.map(|p| if p == "penalty" { "frequency_penalty" } else { p });
                ApiError::bad(m, param)
            }
            other => ApiError::internal(other.to_string()),
        }
    }
}
