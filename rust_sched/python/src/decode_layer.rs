//! `pyengine._kernels.DecodeLayer`: a decoder layer's weights held once, and the front of
//! its decode step (`rust_sched/kernels/src/decode_layer.rs`) run on the step's arrays.

use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyReadwriteArray4, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use pyengine_kernels::{LayerCache, LayerWeights, Linear, Norm, StepRows, Weight, WeightData};

use crate::errors::bad_kernel_argument;
use crate::gil::call;
use crate::kernels::{check_disjoint, contiguous, contiguous_mut, span};

/// What a linear's weight array holds.
#[derive(Clone, Copy)]
enum Kind {
    F32,
    Int8,
    Int4,
}

/// A linear's arrays as given: the weight (float32 [n, k], int8 [n, k] or uint8 int4
/// nibbles [n, k / 2]), its scales and biases ([n, k / group], integer weights), the
/// group size and the output bias [n].
struct LinearArrays {
    kind: Kind,
    weight: Py<PyAny>,
    scales: Option<Py<PyAny>>,
    biases: Option<Py<PyAny>>,
    group_size: usize,
    bias: Option<Py<PyAny>>,
}

/// A linear as Python passes it: (weight, scales, biases, group_size, bias).
type LinearTuple<'py> = (
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
    usize,
    Option<Bound<'py, PyAny>>,
);

/// The arrays of a [`LinearArrays`] borrowed for one call.
struct Borrowed<'py> {
    float: Option<PyReadonlyArray2<'py, f32>>,
    int8: Option<PyReadonlyArray2<'py, i8>>,
    int4: Option<PyReadonlyArray2<'py, u8>>,
    scales: Option<PyReadonlyArray2<'py, f32>>,
    biases: Option<PyReadonlyArray2<'py, f32>>,
    bias: Option<PyReadonlyArray1<'py, f32>>,
    group_size: usize,
}

impl LinearArrays {
    fn new(py: Python<'_>, name: &str, parts: &Bound<'_, PyAny>) -> PyResult<Self> {
        let (weight, scales, biases, group_size, bias): LinearTuple<'_> = parts.extract().map_err(|_| {
            bad_kernel_argument(format!("{name}: expected (weight, scales, biases, group_size, bias)"))
        })?;
        let kind = if weight.extract::<PyReadonlyArray2<'_, f32>>().is_ok() {
            Kind::F32
        } else if weight.extract::<PyReadonlyArray2<'_, i8>>().is_ok() {
            Kind::Int8
        } else if weight.extract::<PyReadonlyArray2<'_, u8>>().is_ok() {
            Kind::Int4
        } else {
            return Err(bad_kernel_argument(format!(
                "{name}: the weight must be a float32, int8 or uint8 matrix"
            )));
        };
        if matches!(kind, Kind::F32) != scales.is_none() {
            return Err(bad_kernel_argument(format!(
                "{name}: integer weights take scales, float32 ones none"
            )));
        }
        let linear = LinearArrays {
            kind,
            weight: weight.unbind(),
            scales: scales.map(Bound::unbind),
            biases: biases.map(Bound::unbind),
            group_size,
            bias: bias.map(Bound::unbind),
        };
        linear.borrow(py, name)?.linear(name)?; // dtypes and layout; the kernels check shapes per call
        Ok(linear)
    }

    fn borrow<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Borrowed<'py>> {
        let bad = |what: &str| bad_kernel_argument(format!("{name}: {what}"));
        let matrix = |array: &Py<PyAny>| {
            array
                .bind(py)
                .extract::<PyReadonlyArray2<'py, f32>>()
                .map_err(|_| bad("scales and biases must be float32 matrices"))
        };
        let mut borrowed = Borrowed {
            float: None,
            int8: None,
            int4: None,
            scales: self.scales.as_ref().map(matrix).transpose()?,
            biases: self.biases.as_ref().map(matrix).transpose()?,
            bias: self
                .bias
                .as_ref()
                .map(|b| {
                    b.bind(py)
                        .extract::<PyReadonlyArray1<'py, f32>>()
                        .map_err(|_| bad("the bias must be a float32 vector"))
                })
                .transpose()?,
            group_size: self.group_size,
        };
        let weight = self.weight.bind(py);
        let wrong = |_| bad("the weight's type changed");
        match self.kind {
            Kind::F32 => borrowed.float = Some(weight.extract().map_err(wrong)?),
            Kind::Int8 => borrowed.int8 = Some(weight.extract().map_err(wrong)?),
            Kind::Int4 => borrowed.int4 = Some(weight.extract().map_err(wrong)?),
        }
        Ok(borrowed)
    }
}

impl Borrowed<'_> {
    fn linear(&self, name: &str) -> PyResult<Linear<'_>> {
        let (data, shape, k) = if let Some(w) = &self.float {
            (WeightData::F32(contiguous(name, w.as_slice())?), w.shape(), w.shape()[1])
        } else if let Some(w) = &self.int8 {
            (WeightData::Int8(contiguous(name, w.as_slice())?), w.shape(), w.shape()[1])
        } else {
            let w = self.int4.as_ref().expect("one of the three");
            (WeightData::Int4(contiguous(name, w.as_slice())?), w.shape(), 2 * w.shape()[1])
        };
        let float = matches!(data, WeightData::F32(_));
        let weight = Weight {
            data,
            scales: self.scales.as_ref().map(|s| contiguous(name, s.as_slice())).transpose()?,
            biases: self.biases.as_ref().map(|b| contiguous(name, b.as_slice())).transpose()?,
            out_features: shape[0],
            in_features: k,
            group_size: if float { k } else { self.group_size },
        };
        let bias = self.bias.as_ref().map(|b| contiguous(name, b.as_slice())).transpose()?;
        Ok(Linear { weight, bias })
    }

    fn spans(&self) -> Vec<(&'static str, (usize, usize))> {
        let mut spans = Vec::new();
        spans.extend(self.float.as_ref().map(|w| ("weight", span(&**w))));
        spans.extend(self.int8.as_ref().map(|w| ("weight", span(&**w))));
        spans.extend(self.int4.as_ref().map(|w| ("weight", span(&**w))));
        spans.extend(self.scales.as_ref().map(|s| ("scales", span(&**s))));
        spans.extend(self.biases.as_ref().map(|b| ("biases", span(&**b))));
        spans.extend(self.bias.as_ref().map(|b| ("bias", span(&**b))));
        spans
    }
}

/// One decoder layer's weights (held, not copied) and attention shape, for
/// [`DecodeLayer::run`]. Built once per layer after the weights are final; the arrays
/// must not be resized or replaced after.
#[pyclass(name = "DecodeLayer", module = "pyengine._kernels", frozen)]
pub struct DecodeLayer {
    input_norm: Py<PyAny>,
    post_norm: Py<PyAny>,
    eps: f32,
    post_eps: f32,
    qkv: LinearArrays,
    o: LinearArrays,
    gate_up: LinearArrays,
    q_norm: Option<Py<PyAny>>,
    k_norm: Option<Py<PyAny>>,
    qk_eps: f32,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    softcap: f32,
}

fn norm<'a>(weight: &'a PyReadonlyArray1<'_, f32>, name: &str, eps: f32) -> PyResult<Norm<'a>> {
    Ok(Norm { weight: contiguous(name, weight.as_slice())?, eps })
}

fn vector<'py>(py: Python<'py>, array: &Py<PyAny>, name: &str) -> PyResult<PyReadonlyArray1<'py, f32>> {
    array.bind(py).extract().map_err(|_| bad_kernel_argument(format!("{name} must be a float32 vector")))
}

#[pymethods]
impl DecodeLayer {
    #[new]
    #[pyo3(signature = (input_norm, eps, post_norm, post_eps, qkv, o, gate_up, q_norm, k_norm, qk_eps, heads, kv_heads, head_dim, scale, softcap = 0.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        input_norm: Bound<'_, PyAny>,
        eps: f32,
        post_norm: Bound<'_, PyAny>,
        post_eps: f32,
        qkv: Bound<'_, PyAny>,
        o: Bound<'_, PyAny>,
        gate_up: Bound<'_, PyAny>,
        q_norm: Option<Bound<'_, PyAny>>,
        k_norm: Option<Bound<'_, PyAny>>,
        qk_eps: f32,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        scale: f32,
        softcap: f32,
    ) -> PyResult<Self> {
        let layer = DecodeLayer {
            input_norm: input_norm.unbind(),
            post_norm: post_norm.unbind(),
            eps,
            post_eps,
            qkv: LinearArrays::new(py, "qkv", &qkv)?,
            o: LinearArrays::new(py, "o", &o)?,
            gate_up: LinearArrays::new(py, "gate_up", &gate_up)?,
            q_norm: q_norm.map(Bound::unbind),
            k_norm: k_norm.map(Bound::unbind),
            qk_eps,
            heads,
            kv_heads,
            head_dim,
            scale,
            softcap,
        };
        for (name, array) in [("input_norm", &layer.input_norm), ("post_norm", &layer.post_norm)] {
            vector(py, array, name)?;
        }
        for (name, array) in [("q_norm", &layer.q_norm), ("k_norm", &layer.k_norm)] {
            if let Some(array) = array {
                vector(py, array, name)?;
            }
        }
        Ok(layer)
    }

    /// The front of the layer's decode step for the step's rows (see
    /// `rust_sched/kernels/src/decode_layer.rs`): `residual` set to `hidden` when `first`,
    /// else added to; the new keys and values written into the layer's caches
    /// (`[blocks, block_size, kv_heads, head_dim]`); `gate_up` [rows, outputs] written.
    /// Attention covers each row's last `window` positions (0: all of them).
    #[pyo3(signature = (gate_up, residual, hidden, first, cos, sin, key_cache, value_cache, slots, block_tables, seq_lens, num_threads = 1, window = 0))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        mut gate_up: PyReadwriteArray2<'_, f32>,
        mut residual: PyReadwriteArray2<'_, f32>,
        hidden: PyReadonlyArray2<'_, f32>,
        first: bool,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        mut key_cache: PyReadwriteArray4<'_, f32>,
        mut value_cache: PyReadwriteArray4<'_, f32>,
        slots: PyReadonlyArray1<'_, i64>,
        block_tables: PyReadonlyArray2<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        num_threads: usize,
        window: usize,
    ) -> PyResult<()> {
        let (qkv, o, up) =
            (self.qkv.borrow(py, "qkv")?, self.o.borrow(py, "o")?, self.gate_up.borrow(py, "gate_up")?);
        let input_norm = vector(py, &self.input_norm, "input_norm")?;
        let post_norm = vector(py, &self.post_norm, "post_norm")?;
        let q_norm = self.q_norm.as_ref().map(|a| vector(py, a, "q_norm")).transpose()?;
        let k_norm = self.k_norm.as_ref().map(|a| vector(py, a, "k_norm")).transpose()?;
        let mut read = vec![
            ("hidden", span(&*hidden)),
            ("cos", span(&*cos)),
            ("sin", span(&*sin)),
            ("slots", span(&*slots)),
            ("block_tables", span(&*block_tables)),
            ("seq_lens", span(&*seq_lens)),
            ("input_norm", span(&*input_norm)),
            ("post_norm", span(&*post_norm)),
        ];
        read.extend(q_norm.as_ref().map(|n| ("q_norm", span(&**n))));
        read.extend(k_norm.as_ref().map(|n| ("k_norm", span(&**n))));
        for borrowed in [&qkv, &o, &up] {
            read.extend(borrowed.spans());
        }
        check_disjoint(
            &[
                ("gate_up", span(&**gate_up)),
                ("residual", span(&**residual)),
                ("key_cache", span(&**key_cache)),
                ("value_cache", span(&**value_cache)),
            ],
            &read,
        )?;
        let cache_shape = key_cache.shape().to_vec();
        if value_cache.shape() != cache_shape.as_slice()
            || cache_shape[2] != self.kv_heads
            || cache_shape[3] != self.head_dim
        {
            return Err(bad_kernel_argument(format!(
                "DecodeLayer.run: the caches must both be [blocks, block_size, {}, {}], got {cache_shape:?} and {:?}",
                self.kv_heads,
                self.head_dim,
                value_cache.shape()
            )));
        }
        let layer = LayerWeights {
            input_norm: norm(&input_norm, "input_norm", self.eps)?,
            post_norm: norm(&post_norm, "post_norm", self.post_eps)?,
            qkv: qkv.linear("qkv")?,
            o: o.linear("o")?,
            gate_up: up.linear("gate_up")?,
            q_norm: q_norm.as_ref().map(|n| norm(n, "q_norm", self.qk_eps)).transpose()?,
            k_norm: k_norm.as_ref().map(|n| norm(n, "k_norm", self.qk_eps)).transpose()?,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            scale: self.scale,
            window,
            softcap: self.softcap,
        };
        let step = StepRows {
            slots: contiguous("slots", slots.as_slice())?,
            block_tables: contiguous("block_tables", block_tables.as_slice())?,
            table_width: block_tables.shape()[1],
            seq_lens: contiguous("seq_lens", seq_lens.as_slice())?,
            cos: contiguous("cos", cos.as_slice())?,
            sin: contiguous("sin", sin.as_slice())?,
        };
        let cache = LayerCache {
            keys: contiguous_mut("key_cache", key_cache.as_slice_mut())?,
            values: contiguous_mut("value_cache", value_cache.as_slice_mut())?,
            block_size: cache_shape[1],
        };
        let hidden = contiguous("hidden", hidden.as_slice())?;
        let residual = contiguous_mut("residual", residual.as_slice_mut())?;
        let gate_up = contiguous_mut("gate_up", gate_up.as_slice_mut())?;
        call(py, || {
            pyengine_kernels::decode_layer_front(
                &layer,
                hidden,
                residual,
                first,
                cache,
                &step,
                gate_up,
                num_threads,
            )
        })
    }
}
