//! [`Attachment`]: the caller's data that travels through the scheduler without being
//! read by it.
//!
//! A request's per-sample parameters (sampling or pooling settings) ride with it into the
//! plan that schedules each sample (again after a preemption), and an executor's step
//! result (log-probabilities, pooled vectors, an error) rides with the sampled ids into
//! that step's output event. So everything the executor and the output thread need
//! crosses the channels, and no side table is shared between the threads. The core only
//! clones and moves attachments; the bindings put Python objects in them.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// Opaque, cheaply cloned (one reference count) data of the caller's.
#[derive(Clone)]
pub struct Attachment(Arc<dyn Any + Send + Sync>);

impl Attachment {
    pub fn new<T: Any + Send + Sync>(value: T) -> Self {
        Attachment(Arc::new(value))
    }

    /// The value, if it is a `T`.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl fmt::Debug for Attachment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Attachment(..)")
    }
}

/// Two attachments are equal when they are the same value (not merely equal contents).
impl PartialEq for Attachment {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_the_value_and_compare_by_identity() {
        let a = Attachment::new(7u32);
        let b = a.clone();
        assert_eq!(a, b);
        assert_eq!(b.get::<u32>(), Some(&7));
        assert_eq!(b.get::<i64>(), None);
        assert_ne!(a, Attachment::new(7u32));
    }
}
