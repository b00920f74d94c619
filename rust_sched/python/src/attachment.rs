//! Python objects as the core's [`Attachment`]s: a request's per-sample parameters and an
//! executor's step result travel through the scheduler's channels as the objects
//! themselves, one reference count each, never read by Rust.

use pyo3::prelude::*;
use pyo3::types::PyList;

use pyengine_sched::Attachment;

/// Wraps a Python object (None stays no attachment).
pub fn attach(obj: Option<Bound<'_, PyAny>>) -> Option<Attachment> {
    obj.filter(|o| !o.is_none()).map(|o| Attachment::new(o.unbind()))
}

/// The Python object inside `attachment`, or None.
pub fn detach_object(py: Python<'_>, attachment: Option<&Attachment>) -> Py<PyAny> {
    attachment.and_then(|a| a.get::<Py<PyAny>>()).map_or_else(|| py.None(), |o| o.clone_ref(py))
}

/// A list of the objects inside `attachments` (None where absent).
pub fn object_list(py: Python<'_>, attachments: &[Option<Attachment>]) -> PyResult<Py<PyList>> {
    let objects = attachments.iter().map(|a| detach_object(py, a.as_ref()));
    Ok(PyList::new(py, objects)?.unbind())
}
