//! The model's vocabulary as llguidance needs it: each token id's bytes, special tokens
//! marked so that no grammar spells them as text, and the EOS ids that end an output.

use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::error::GrammarError;

/// Built once per engine (a pass over the vocabulary) and shared by every grammar.
#[derive(Clone)]
pub struct Vocabulary {
    env: TokEnv,
    vocab_size: usize,
}

impl Vocabulary {
    /// `token_bytes[i]` is token `i`'s bytes (empty: never allowed by a grammar). Ids in
    /// `special` are control tokens (a grammar never produces them as text); `eos` are the
    /// ids that end a sequence, allowed where the grammar may end. `vocab_size` is the
    /// logits' width (at least `token_bytes.len()`; ids past the tokenizer's are never
    /// allowed).
    pub fn new(
        mut token_bytes: Vec<Vec<u8>>,
        special: &[u32],
        eos: &[u32],
        vocab_size: usize,
    ) -> Result<Vocabulary, GrammarError> {
        let bad = |m: String| Err(GrammarError::InvalidVocabulary(m));
        if token_bytes.len() > vocab_size {
            return bad(format!("{} token byte strings for a vocabulary of {vocab_size}", token_bytes.len()));
        }
        if vocab_size == 0 || vocab_size > u32::MAX as usize {
            return bad(format!("vocabulary size {vocab_size} is out of range"));
        }
        if eos.is_empty() {
            return bad("no end-of-sequence token id: a grammar could never end".into());
        }
        if let Some(&t) = eos.iter().chain(special).find(|&&t| t as usize >= vocab_size) {
            return bad(format!("token id {t} is outside the vocabulary (size {vocab_size})"));
        }
        token_bytes.resize(vocab_size, Vec::new());
        for &t in special.iter().chain(eos) {
            let bytes = &mut token_bytes[t as usize];
            if bytes.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                // llguidance's marker for a control token: never matched as text.
                let name =
                    if bytes.is_empty() { format!("<|special_{t}|>").into_bytes() } else { bytes.clone() };
                *bytes = [vec![TokTrie::SPECIAL_TOKEN_MARKER], name].concat();
            }
        }
        let info = TokRxInfo {
            vocab_size: vocab_size as u32,
            tok_eos: eos[0],
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &token_bytes).with_eos_tokens(eos);
        Ok(Vocabulary { env: Arc::new(ApproximateTokEnv::new(trie)), vocab_size })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// 32-bit words per mask row.
    pub fn mask_words(&self) -> usize {
        self.vocab_size.div_ceil(32)
    }

    pub(crate) fn env(&self) -> &TokEnv {
        &self.env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_inconsistent_inputs() {
        assert!(Vocabulary::new(vec![b"a".to_vec(); 4], &[], &[1], 3).is_err());
        assert!(Vocabulary::new(vec![b"a".to_vec(); 4], &[], &[], 4).is_err());
        assert!(Vocabulary::new(vec![b"a".to_vec(); 4], &[], &[9], 4).is_err());
        assert!(Vocabulary::new(vec![b"a".to_vec(); 4], &[7], &[1], 4).is_err());
        let v = Vocabulary::new(vec![b"a".to_vec(); 4], &[2], &[1], 40).unwrap();
        assert_eq!(v.mask_words(), 2);
    }
}
