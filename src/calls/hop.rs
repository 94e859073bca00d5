//! Which headers of an HTTP message belong to one connection (hop-by-hop, RFC 9110 §7.6.1) and
//! which go on with it, for the routes that pass a message on as it came: the ports proxy into a
//! sandbox and the hand-over of a call to the replica that holds its session.
//!
//! Owns: the hop-by-hop set and whether a request asks for an upgrade. Must not: decide which
//! other headers a route drops (each passes its own).

use axum::http::{HeaderMap, HeaderValue, header};

/// Headers that belong to one connection (RFC 9110 §7.6.1), never passed on.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
];

/// `headers` without the hop-by-hop ones (those `Connection` names too), and without `Upgrade`
/// unless `upgrade` keeps it (with `Connection: upgrade`).
pub(crate) fn end_to_end(headers: &HeaderMap, upgrade: bool, drop_also: &[&str]) -> HeaderMap {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty() && t != "upgrade")
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let n = name.as_str();
        if HOP_BY_HOP.contains(&n)
            || drop_also.contains(&n)
            || named.iter().any(|t| t == n)
            || (n == "upgrade" && !upgrade)
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if upgrade {
        out.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    out
}

/// Whether the request asks for a protocol upgrade (a WebSocket).
pub(crate) fn wants_upgrade(headers: &HeaderMap) -> bool {
    let connection_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    connection_upgrade && headers.contains_key(header::UPGRADE)
}
