//! The error type every store operation returns.

use std::fmt;

/// Why a store operation failed.
#[derive(Debug)]
pub enum StoreError {
    /// The backend failed: connection, timeout, script or protocol error.
    Backend(String),
    /// A stored record could not be decoded (written by an incompatible version, or edited by hand).
    Corrupt {
        /// Id of the response whose stored data is unreadable.
        id: String,
        /// What was wrong with it.
        reason: String,
    },
    /// A stored session pin could not be decoded (written by an incompatible version, or edited
    /// by hand).
    CorruptPin {
        /// Store key of the pin.
        key: String,
        /// What was wrong with it.
        reason: String,
    },
    /// The store URL could not be used.
    InvalidUrl(String),
    /// A response of the chain ending at `id` is gone without having been deleted (evicted,
    /// or lost with a restart of the store): its history cannot be rebuilt whole.
    Lost {
        /// Id of the response whose history was asked for.
        id: String,
        /// Id of the predecessor that is gone.
        missing: String,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Backend(msg) => write!(
                f,
                "session store backend error: {msg} (check that Redis is reachable and healthy)"
            ),
            StoreError::Corrupt { id, reason } => write!(
                f,
                "stored response {id} is unreadable: {reason} (delete it, or check that all gateway replicas run the same version)"
            ),
            StoreError::CorruptPin { key, reason } => write!(
                f,
                "session pin {key} is unreadable: {reason} (delete the key; the session is re-pinned on its next turn)"
            ),
            StoreError::Lost { id, missing } => write!(
                f,
                "response {missing}, earlier in the chain of {id}, is no longer stored (evicted or lost by the store, not deleted); the history cannot be rebuilt"
            ),
            StoreError::InvalidUrl(msg) => write!(
                f,
                "invalid session store URL: {msg} (expected redis://host:port/db)"
            ),
        }
    }
}

impl std::error::Error for StoreError {}

impl From<::redis::RedisError> for StoreError {
    fn from(err: ::redis::RedisError) -> Self {
        StoreError::Backend(err.to_string())
    }
}
