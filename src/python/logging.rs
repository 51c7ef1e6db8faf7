//! Forwards the core's `tracing` events to Python's `logging` (logger `detspec`), so engine
//! messages show up wherever the application's logging goes. The level comes from the
//! `DETSPEC_LOG` environment variable (error, warn, info, debug, trace; default warn).

use std::fmt::Write as _;

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

struct PythonLogging {
    max: Level,
}

/// Collects an event's fields as `message key=value ...`.
struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

/// Python logging's numeric level for a tracing level.
fn python_level(level: &Level) -> u32 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        Level::TRACE => 5,
    }
}

impl Subscriber for PythonLogging {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= &self.max
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _span: &Id, _values: &Record<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        let level = python_level(event.metadata().level());
        let target = event.metadata().target().to_string();
        // `try_attach`: never touch an interpreter that is shutting down.
        Python::try_attach(|py| {
            let _ = py
                .import("logging")
                .and_then(|l| l.call_method1("getLogger", ("detspec",)))
                .and_then(|lg| lg.call_method1("log", (level, format!("{target}: {}", fields.0))));
        });
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}

/// Installs the bridge as the global subscriber, unless the process already has one.
pub fn install() {
    let max = match std::env::var("DETSPEC_LOG")
        .unwrap_or_default()
        .to_ascii_lowercase()
        .as_str()
    {
        "error" => Level::ERROR,
        "info" => Level::INFO,
        "debug" => Level::DEBUG,
        "trace" => Level::TRACE,
        _ => Level::WARN,
    };
    let _ = tracing::subscriber::set_global_default(PythonLogging { max });
}
