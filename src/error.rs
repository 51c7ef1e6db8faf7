//! Typed errors for the whole crate.
//!
//! Every message names the thing at fault (file, tensor, field or parameter) because these
//! errors cross into Python as exceptions and are often the only clue a user gets.

use std::path::PathBuf;

/// The crate-wide error type.
#[derive(Debug, thiserror::Error)]
pub enum DetspecError {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file exists but its contents are not what we expect (bad JSON, corrupt safetensors, ...).
    #[error("invalid file {path}: {message}")]
    InvalidFile { path: PathBuf, message: String },

    /// A config field is missing or has an unusable value.
    #[error("invalid config {path}: field `{field}`: {message}")]
    InvalidConfig {
        path: PathBuf,
        field: String,
        message: String,
    },

    /// The checkpoint's `architectures` entry is not one we implement.
    #[error("unsupported architecture `{architecture}` in {path} (supported: {supported})")]
    UnsupportedArchitecture {
        path: PathBuf,
        architecture: String,
        supported: String,
    },

    /// A tensor the model needs is absent from the checkpoint.
    #[error("missing tensor `{name}` in {path}")]
    MissingTensor { name: String, path: PathBuf },

    /// A tensor is present but has the wrong shape or dtype.
    #[error("tensor `{name}` in {path}: {message}")]
    BadTensor {
        name: String,
        path: PathBuf,
        message: String,
    },

    /// The model (weights and KV cache as configured) does not fit in the memory available;
    /// raised before anything is allocated.
    #[error("{path} needs {} of memory ({detail}), but {} is available", gib(*needed), gib(*available))]
    OutOfMemory {
        path: PathBuf,
        needed: u64,
        available: u64,
        detail: String,
    },

    /// A sampling or engine parameter is out of range.
    #[error("invalid parameter `{name}`: {message}")]
    InvalidParameter { name: String, message: String },

    /// A request cannot be served as given (prompt too long, empty prompt, unknown token id, ...).
    #[error("invalid request{}: {message}", request_id.as_deref().map(|r| format!(" `{r}`")).unwrap_or_default())]
    InvalidRequest {
        request_id: Option<String>,
        message: String,
    },

    /// Tokenizer or chat-template failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The KV page pool cannot satisfy a reservation.
    #[error("KV cache out of pages: need {needed}, {free} free of {total}")]
    OutOfPages {
        needed: usize,
        free: usize,
        total: usize,
    },

    /// The engine has stopped and accepts no more work.
    #[error("engine is shut down")]
    EngineStopped,

    /// An error from candle inside a kernel or tensor op. These indicate a bug or an
    /// unsupported device rather than bad user input.
    #[error("tensor op failed: {0}")]
    Candle(#[from] candle_core::Error),
}

impl DetspecError {
    /// Shorthand for [`DetspecError::InvalidParameter`].
    pub fn param(name: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidParameter {
            name: name.into(),
            message: message.into(),
        }
    }

    /// The parameter at fault, for errors that name one (a request parameter, or the tensor
    /// of a weight update): Python's `DetspecError.param`, the HTTP error body's `param`.
    pub fn param_name(&self) -> Option<&str> {
        match self {
            Self::InvalidParameter { name, .. } => Some(name),
            // A weight update's parameter at fault is the tensor.
            Self::MissingTensor { name, .. } | Self::BadTensor { name, .. } => Some(name),
            _ => None,
        }
    }

    /// Shorthand for [`DetspecError::InvalidFile`].
    pub fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::InvalidFile {
            path: path.into(),
            message: message.into(),
        }
    }

    /// Shorthand for [`DetspecError::Io`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// Bytes as GiB with one decimal, for messages.
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Crate-wide result alias.
pub type Result<T, E = DetspecError> = std::result::Result<T, E>;
