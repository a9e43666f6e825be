//! Test helpers: tiny tokenizers built in memory, temp dirs, Parquet fixtures.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{Field, Schema};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use tokenizers::Tokenizer;

use crate::cpu::quant::WeightType;

/// Word-level tokenizer: ids 0..3 are `<unk> <bos> <eos> <pad>` (special), then `w4 .. w{n-1}`;
/// whitespace pre-tokenizer, no decoder (decode joins tokens with spaces).
pub fn word_level_tokenizer(n: usize) -> Tokenizer {
    let mut vocab = serde_json_map(&["<unk>", "<bos>", "<eos>", "<pad>"]);
    for i in 4..n {
        vocab.push(format!("\"w{i}\": {i}"));
    }
    let json = format!(
        r#"{{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}},
    {{"id": 1, "content": "<bos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}},
    {{"id": 2, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}},
    {{"id": 3, "content": "<pad>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}
  ],
  "normalizer": null,
  "pre_tokenizer": {{"type": "Whitespace"}},
  "post_processor": {{
    "type": "TemplateProcessing",
    "single": [{{"SpecialToken": {{"id": "<bos>", "type_id": 0}}}}, {{"Sequence": {{"id": "A", "type_id": 0}}}}],
    "pair": [{{"SpecialToken": {{"id": "<bos>", "type_id": 0}}}}, {{"Sequence": {{"id": "A", "type_id": 0}}}}, {{"Sequence": {{"id": "B", "type_id": 1}}}}],
    "special_tokens": {{"<bos>": {{"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}}}}
  }},
  "decoder": null,
  "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "<unk>"}}
}}"#,
        vocab.join(", ")
    );
    Tokenizer::from_bytes(json.as_bytes()).expect("word-level tokenizer json")
}

fn serde_json_map(tokens: &[&str]) -> Vec<String> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| format!("\"{t}\": {i}"))
        .collect()
}

/// GPT-2 / Llama-3 style byte-level BPE: a `Split` pre-tokenizer with the Llama-3 regex (needs
/// look-ahead, i.e. the fancy-regex backend), `ByteLevel` pre-tokenizer/decoder, the 256 byte
/// symbols as vocabulary plus one merge, and a special `<|eot|>` token.
pub fn byte_level_tokenizer() -> Tokenizer {
    let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
    let mut chars: Vec<char> = alphabet.into_iter().collect();
    chars.sort();
    let mut vocab: Vec<String> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| format!("{}: {i}", json_string(&c.to_string())))
        .collect();
    let n = chars.len();
    vocab.push(format!("\"he\": {n}"));
    vocab.push(format!("\"<|eot|>\": {}", n + 1));
    let regex = r#"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"#;
    let json = format!(
        r#"{{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {{"id": {eot}, "content": "<|eot|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}
  ],
  "normalizer": null,
  "pre_tokenizer": {{"type": "Sequence", "pretokenizers": [
    {{"type": "Split", "pattern": {{"Regex": {regex}}}, "behavior": "Isolated", "invert": false}},
    {{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}}
  ]}},
  "post_processor": {{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}},
  "decoder": {{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}},
  "model": {{"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": {{{vocab}}}, "merges": ["h e"]}}
}}"#,
        eot = n + 1,
        regex = json_string(regex),
        vocab = vocab.join(", "),
    );
    Tokenizer::from_bytes(json.as_bytes()).expect("byte-level tokenizer json")
}

/// A JSON string literal (quotes and escapes).
pub fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A fresh, empty directory under the system temp dir (removed by `TempDir::drop`).
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("eaglebatch-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `columns` as one Parquet file (snappy) with row groups of `row_group_rows` rows.
pub fn write_parquet(path: &Path, columns: Vec<(&str, ArrayRef)>, row_group_rows: usize) {
    let fields: Vec<Field> = columns
        .iter()
        .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
        .collect();
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(
        schema.clone(),
        columns.into_iter().map(|(_, a)| a).collect(),
    )
    .unwrap();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .set_max_row_group_row_count(Some(row_group_rows))
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut w = ArrowWriter::try_new(file, schema, Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

/// Overwrites every column chunk of row group `g` of a Parquet file (page headers and data)
/// with garbage, keeping the footer valid: the file passes validation, reading `g` fails.
pub fn corrupt_row_group(path: &Path, g: usize) {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let reader = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let mut bytes = std::fs::read(path).unwrap();
    for col in reader.metadata().row_group(g).columns() {
        let (start, len) = col.byte_range();
        bytes[start as usize..(start + len) as usize].fill(0xA5);
    }
    std::fs::write(path, bytes).unwrap();
}

/// Every record batch of the part files of an output directory, in file-name order; any other
/// file there (a stray or temporary file) fails the test.
pub fn read_parts(dir: &Path) -> Vec<RecordBatch> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let name = f.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.starts_with("part-") && name.ends_with(".parquet"),
            "stray file {name}"
        );
        let file = std::fs::File::open(&f).unwrap();
        let reader = ParquetRecordBatchReaderBuilder::try_new(file)
            .unwrap()
            .build()
            .unwrap();
        out.extend(reader.map(|b| b.unwrap()));
    }
    out
}

/// Saves a tokenizer as tokenizer.json in `dir` and returns its path.
pub fn save_tokenizer(tok: &Tokenizer, dir: &Path) -> PathBuf {
    let path = dir.join("tokenizer.json");
    tok.save(&path, false).unwrap();
    path
}

/// `len` deterministic floats in [-0.5, 0.5) from `seed` (xorshift), for kernel tests.
pub fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// `len` pseudo-random bytes from `seed` (xorshift, like `values`).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect()
}

/// `rows` rows of `k` elements of block type `ty` with random contents whose fp16 scale and
/// offset fields are finite (normal or subnormal, either sign; MXFP4: exponents that keep every
/// value finite, the subnormal scales included): every such block is valid.
pub fn random_blocks(ty: WeightType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    use WeightType as T;
    let (elems, bytes) = ty.block();
    let mut data = random_bytes(rows * k / elems * bytes, seed);
    let halves: &[usize] = match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 => &[0],
        T::Q4_1 | T::Q5_1 | T::Q4K => &[0, 2],
        T::Q6K => &[208],
        T::F32 | T::F16 | T::Bf16 | T::Mxfp4 => &[],
    };
    for (i, block) in data.chunks_exact_mut(bytes).enumerate() {
        if ty == T::Mxfp4 {
            // E8M0 exponents 0 and 1 (subnormal scales), 2, and 118..=137 (values up to ~6e3)
            block[0] = if i % 7 == 0 {
                (i % 3) as u8
            } else {
                118 + (i % 20) as u8
            };
        }
        for &at in halves {
            // exponent field 0..=20 (subnormals included, no inf/NaN), random sign and fraction
            let h = u16::from_le_bytes([block[at], block[at + 1]]);
            let exp = (i as u16 * 7 + at as u16) % 21;
            let h = (h & 0x83ff) | (exp << 10);
            block[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    data
}
