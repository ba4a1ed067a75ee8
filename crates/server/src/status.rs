//! gRPC status codes as upstream's grpc-go server answers them, where tonic differs: a request
//! that is not valid protobuf is the caller's fault (`InvalidArgument`, tonic says `Internal`),
//! and a request over the size limit is `ResourceExhausted` (tonic says `OutOfRange`).
//! Both errors come from tonic's codec before our handler runs, so they are rewritten on the
//! way out, in the trailers-only response tonic sends for them.

use http::header::HeaderValue;
use tonic::Code;

/// How tonic words a request that is not valid protobuf (prost's `DecodeError`).
const DECODE_ERROR: &str = "failed to decode Protobuf message";
/// How tonic words a request over the decoding limit.
const TOO_LARGE: &str = "Error, decoded message length too large";

/// Rewrites the status of a trailers-only gRPC error response where upstream differs.
pub fn upstream_status_codes<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let code = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(Code::from);
    let message = headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(percent_decode)
        .unwrap_or_default();
    let new = match code {
        Some(Code::Internal) if message.starts_with(DECODE_ERROR) => Code::InvalidArgument,
        Some(Code::OutOfRange) if message.starts_with(TOO_LARGE) => Code::ResourceExhausted,
        _ => return response,
    };
    headers.insert("grpc-status", HeaderValue::from(new as i32));
    response
}

/// Undoes the percent-encoding of `grpc-message`.
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_of(status: tonic::Status) -> (i32, String) {
        let response = upstream_status_codes(status.into_http::<()>());
        let h = response.headers();
        (
            h["grpc-status"].to_str().unwrap().parse().unwrap(),
            percent_decode(h["grpc-message"].to_str().unwrap()),
        )
    }

    #[test]
    fn decode_errors_become_invalid_argument() {
        let (code, message) = status_of(tonic::Status::internal(format!(
            "{DECODE_ERROR}: invalid wire type"
        )));
        assert_eq!(code, Code::InvalidArgument as i32);
        assert!(message.contains("invalid wire type"), "{message}");
    }

    #[test]
    fn oversized_requests_become_resource_exhausted() {
        let (code, _) = status_of(tonic::Status::out_of_range(format!(
            "{TOO_LARGE}: found 2000000 bytes, the limit is: 1048576 bytes"
        )));
        assert_eq!(code, Code::ResourceExhausted as i32);
    }

    #[test]
    fn other_statuses_are_untouched() {
        for status in [
            tonic::Status::internal("database exploded"),
            tonic::Status::out_of_range("generation 7 is in the future"),
            tonic::Status::unauthenticated("wrong key"),
        ] {
            let code = status.code() as i32;
            assert_eq!(status_of(status).0, code);
        }
    }
}
