//! Tracing output: the JSON log lines on stderr, and, when an OTLP endpoint is configured, the
//! request spans exported over OTLP/HTTP (protobuf).
//!
//! Owns: the subscriber, the OpenTelemetry tracer provider and its flush at shutdown, and the W3C
//! `traceparent` of an incoming request. Knows nothing of the daemon's modules: the spans
//! themselves are opened where their steps happen (`http.request` in `api`, `auth` in `auth`,
//! `policy.decide` and `sandbox.run` in `execution`, `audit.append` in `provenance`).
//!
//! Without `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) no OpenTelemetry
//! layer is installed at all: nothing is exported, no trace context is parsed.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context as _, Result};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The service name spans are exported under when `OTEL_SERVICE_NAME` is not set.
pub const DEFAULT_SERVICE_NAME: &str = "executor-arm";

/// The variables that turn export on (the second names the traces endpoint only).
const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// Whether spans are exported (an OpenTelemetry layer is installed).
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// The installed tracing: hold it for the daemon's life, and [`Telemetry::shutdown`] it once the
/// daemon stopped, so that the last spans are exported.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports the spans still queued and stops the exporter (nothing, when not exporting).
    /// Called from outside the runtime the exporter runs on (it blocks until the flush is done),
    /// while that runtime still runs.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            EXPORTING.store(false, Ordering::SeqCst);
            if let Err(e) = provider.shutdown() {
                tracing::warn!(error = %e, "OTLP span exporter: final flush failed");
            }
        }
    }
}

/// Whether one of [`ENDPOINT_VARS`] is set to something.
fn endpoint_configured() -> bool {
    ENDPOINT_VARS
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// Installs the global subscriber: the JSON log lines on stderr (`RUST_LOG`, default `info`),
/// exactly as without export, and, when an OTLP endpoint is configured, the OpenTelemetry layer
/// with a batch exporter running on the current tokio runtime (so this must run inside one).
pub fn init() -> Result<Telemetry> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Log lines carry their own fields only: the spans a line is emitted in do not change it.
    let logs = tracing_subscriber::fmt::layer()
        .json()
        .with_current_span(false)
        .with_span_list(false)
        .with_writer(std::io::stderr)
        .with_filter(filter);
    if !endpoint_configured() {
        tracing_subscriber::registry().with(logs).init();
        return Ok(Telemetry { provider: None });
    }
    let provider = provider()?;
    // The daemon's own spans and events only: nothing of its dependencies (the exporter's HTTP
    // client included), whatever RUST_LOG says.
    let only_ours = tracing_subscriber::filter::Targets::new()
        .with_target("executor_arm", tracing::Level::INFO);
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("executor-arm"))
        .with_filter(only_ours);
    tracing_subscriber::registry().with(logs).with(spans).init();
    EXPORTING.store(true, Ordering::SeqCst);
    Ok(Telemetry {
        provider: Some(provider),
    })
}

/// The tracer provider: OTLP/HTTP protobuf to the endpoint the standard variables name (the
/// crate reads `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT` plus
/// `/v1/traces`, and `OTEL_EXPORTER_OTLP_HEADERS`, `_TIMEOUT`), batched on the tokio runtime.
fn provider() -> Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .context("OTLP span exporter")?;
    let processor =
        BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_string());
    let resource = Resource::builder()
        .with_service_name(service)
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource)
        .build())
}

/// Makes the trace context of an incoming request's `traceparent` (and `tracestate`) header the
/// parent of `span`, which must not have been entered yet. Nothing when not exporting, or when
/// the request carries no valid `traceparent` (the span then starts a trace of its own).
pub fn set_remote_parent(span: &tracing::Span, headers: &axum::http::HeaderMap) {
    if !EXPORTING.load(Ordering::Relaxed) || !headers.contains_key("traceparent") {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    if let Err(e) = span.set_parent(cx) {
        tracing::debug!(error = %e, "traceparent not applied");
    }
}

/// Writes the current span's trace context as `traceparent` (and `tracestate`) into the
/// headers of a request this daemon sends on (a call forwarded to another replica). Nothing when
/// not exporting.
pub fn inject_current(headers: &mut axum::http::HeaderMap) {
    if !EXPORTING.load(Ordering::Relaxed) {
        return;
    }
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut HeadersMut(headers));
}

/// An outgoing request's headers, as the propagator writes them.
struct HeadersMut<'a>(&'a mut axum::http::HeaderMap);

impl opentelemetry::propagation::Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(key.as_bytes()),
            axum::http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// An incoming request's headers, as the propagator reads them.
struct Headers<'a>(&'a axum::http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}
