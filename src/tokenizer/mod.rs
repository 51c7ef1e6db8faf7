//! Tokenization: HuggingFace tokenizer loading ([`Tokenizer`]), EOS-id discovery
//! ([`eos_token_ids`]), streaming detokenization ([`IncrementalDetokenizer`]), stop strings
//! ([`StopChecker`]) and chat templates ([`ChatTemplate`]).

pub mod chat;
pub mod detok;
pub mod hf;
pub mod stop;

pub use chat::{ChatMessage, ChatTemplate};
pub use detok::IncrementalDetokenizer;
pub use hf::{eos_token_ids, from_model_dir, Tokenizer};
pub use stop::{StopChecker, StopMatch};

#[cfg(test)]
pub(crate) mod test_util {
    //! A tiny byte-level BPE tokenizer trained in-process, written into a temporary model
    //! directory.

    use std::path::Path;
    use std::sync::OnceLock;

    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::{
        AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        TokenizerImpl,
    };

    pub const SPECIAL: [&str; 5] = [
        "<|bos|>",
        "<|eos|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|eot_id|>",
    ];

    /// ASCII-only training text, so multi-byte characters stay split into byte tokens.
    fn corpus() -> Vec<String> {
        const WORDS: &str = "the quick brown fox jumps over the lazy dog hello world this is a \
            small corpus used to train a tiny byte level tokenizer for unit tests of the \
            detokenizer stop strings and chat templates system user assistant message content \
            role model inference engine token tokens text stream streaming output input prompt \
            answer question what is the capital of france paris london berlin rome madrid one two \
            three four five six seven eight nine ten you are a helpful assistant please reply \
            briefly thank thanks good morning evening night day week month year stop end";
        let words: Vec<&str> = WORDS.split_whitespace().collect();
        let mut lines = Vec::new();
        for i in 0..words.len() {
            let line: Vec<&str> = (0..12)
                .map(|j| words[(i * 7 + j * 3) % words.len()])
                .collect();
            lines.push(line.join(" "));
        }
        lines.push(WORDS.to_string());
        lines
    }

    /// The trained tokenizer, serialized as `tokenizer.json` contents.
    pub fn tokenizer_json() -> &'static str {
        static JSON: OnceLock<String> = OnceLock::new();
        JSON.get_or_init(|| {
            let mut trainer = BpeTrainerBuilder::new()
                .vocab_size(320)
                .min_frequency(2)
                .show_progress(false)
                .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                .special_tokens(SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect())
                .build();
            let mut tk: TokenizerImpl<
                BPE,
                NormalizerWrapper,
                PreTokenizerWrapper,
                PostProcessorWrapper,
                DecoderWrapper,
            > = TokenizerImpl::new(BPE::default());
            tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
            tk.with_decoder(Some(ByteLevel::default()));
            tk.train(&mut trainer, corpus().into_iter()).unwrap();
            let bos = tk.token_to_id("<|bos|>").unwrap();
            let post = TemplateProcessing::builder()
                .try_single("<|bos|> $A")
                .unwrap()
                .try_pair("<|bos|> $A $B")
                .unwrap()
                .special_tokens(vec![("<|bos|>", bos)])
                .build()
                .unwrap();
            tk.with_post_processor(Some(post));
            let tok = tokenizers::Tokenizer::from(tk);
            tok.to_string(false).unwrap()
        })
    }

    pub fn write(dir: &Path, name: &str, contents: &str) {
        std::fs::write(dir.join(name), contents).unwrap();
    }

    /// A temporary model directory with `tokenizer.json` and a `tokenizer_config.json` naming
    /// `<|bos|>` / `<|eos|>`.
    pub fn model_dir() -> tempfile::TempDir {
        let dir = tempfile::Builder::new()
            .prefix("detspec-tokenizer-test-")
            .tempdir()
            .unwrap();
        write(dir.path(), "tokenizer.json", tokenizer_json());
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": false}"#,
        );
        dir
    }

    pub fn tokenizer() -> super::Tokenizer {
        let tok = tokenizers::Tokenizer::from_bytes(tokenizer_json()).unwrap();
        let mut tok = super::Tokenizer::from_tokenizers(tok, "<test>");
        tok.set_special_tokens(Some("<|bos|>".into()), Some("<|eos|>".into()));
        tok
    }
}
