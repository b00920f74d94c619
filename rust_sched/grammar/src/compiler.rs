//! Compiling constraints, with a cache: the same spec compiled twice is compiled once.
//!
//! Compilation runs in the caller's thread (the bindings release the GIL around it), so
//! a bad schema is refused before the request is queued and the scheduler thread never
//! compiles. Each compiled grammar is checked by computing its first mask: a grammar that
//! fails there, or allows nothing at all, is refused too.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use llguidance::ParserFactory;
use pyengine_sched::constraint::ConstraintState;

use crate::error::GrammarError;
use crate::matcher::CompiledGrammar;
use crate::spec::ConstraintSpec;
use crate::vocabulary::Vocabulary;

/// Compiled grammars kept (least recently used out first).
pub const DEFAULT_CACHE_CAPACITY: usize = 256;

/// A compilation's result.
pub struct Compiled {
    pub grammar: Arc<CompiledGrammar>,
    /// Served from the cache.
    pub cached: bool,
    /// Time this call took (compiling, or looking up), in seconds.
    pub seconds: f64,
}

/// Counters of the compiler, for stats and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CompileStats {
    pub compiled: u64,
    pub cache_hits: u64,
    pub failed: u64,
    pub compile_seconds: f64,
    pub cached_grammars: usize,
}

struct Cache {
    entries: HashMap<ConstraintSpec, (Arc<CompiledGrammar>, u64)>,
    clock: u64,
    stats: CompileStats,
}

/// Compiles [`ConstraintSpec`]s against one vocabulary; shared by every thread that adds
/// requests.
pub struct GrammarCompiler {
    vocab: Vocabulary,
    factory: ParserFactory,
    capacity: usize,
    cache: Mutex<Cache>,
}

impl GrammarCompiler {
    pub fn new(vocab: Vocabulary, capacity: usize) -> Result<GrammarCompiler, GrammarError> {
        let mut factory = ParserFactory::new_simple(vocab.env())
            .map_err(|e| GrammarError::InvalidVocabulary(e.to_string()))?;
        factory.quiet();
        let cache = Cache { entries: HashMap::new(), clock: 0, stats: CompileStats::default() };
        Ok(GrammarCompiler { vocab, factory, capacity: capacity.max(1), cache: Mutex::new(cache) })
    }

    pub fn vocabulary(&self) -> &Vocabulary {
        &self.vocab
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The compiled grammar of `spec`, from the cache when it was compiled before.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Compiled, GrammarError> {
        let started = Instant::now();
        {
            let mut cache = self.lock();
            cache.clock += 1;
            let now = cache.clock;
            if let Some((grammar, used)) = cache.entries.get_mut(spec) {
                *used = now;
                let grammar = grammar.clone();
                cache.stats.cache_hits += 1;
                return Ok(Compiled { grammar, cached: true, seconds: started.elapsed().as_secs_f64() });
            }
        }
        // Compiled outside the lock: other requests' look-ups and compilations go on.
        let result = self.compile_uncached(spec);
        let seconds = started.elapsed().as_secs_f64();
        let mut cache = self.lock();
        let grammar = match result {
            Ok(grammar) => Arc::new(grammar),
            Err(e) => {
                cache.stats.failed += 1;
                return Err(e);
            }
        };
        cache.stats.compiled += 1;
        cache.stats.compile_seconds += seconds;
        if cache.entries.len() >= self.capacity {
            let oldest = cache.entries.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone());
            if let Some(key) = oldest {
                cache.entries.remove(&key);
            }
        }
        let now = cache.clock;
        cache.entries.insert(spec.clone(), (grammar.clone(), now));
        Ok(Compiled { grammar, cached: false, seconds })
    }

    /// The compiled grammar of `spec` if it is cached (nothing is compiled).
    pub fn cached(&self, spec: &ConstraintSpec) -> Option<Arc<CompiledGrammar>> {
        self.lock().entries.get(spec).map(|(g, _)| g.clone())
    }

    fn compile_uncached(&self, spec: &ConstraintSpec) -> Result<CompiledGrammar, GrammarError> {
        let invalid = |reason: String| GrammarError::InvalidConstraint { kind: spec.kind.name(), reason };
        let grammar = spec.to_grammar()?;
        let built = catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(grammar)))
            .map_err(|_| invalid("the grammar compiler failed on it".into()))?
            .map_err(|e| invalid(e.to_string()))?;
        let compiled = CompiledGrammar::new(built, self.vocab.mask_words());
        // The first mask: errors the compiler defers to matching, or nothing allowed.
        let mut first = compiled.matcher();
        let mut mask = vec![0u32; self.vocab.mask_words()];
        if !first.fill_mask(&mut mask) {
            return Err(invalid(match first.error() {
                Some(e) => e,
                None => "it allows no output at all".into(),
            }));
        }
        Ok(compiled)
    }

    pub fn stats(&self) -> CompileStats {
        let cache = self.lock();
        CompileStats { cached_grammars: cache.entries.len(), ..cache.stats }
    }
}
