//! Kept input columns (`keep_columns`) end to end through the reader, the scheduler and the
//! writer: each output row carries its own input row's values, with the column's type (one
//! type across files of different spellings, dictionaries by their values), on error rows and
//! on every sample of a row too.

use std::sync::Arc;

use arrow_array::builder::{Int64Builder, ListBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type, Int8Type};
use arrow_array::{
    Array, ArrayRef, DictionaryArray, Float64Array, Int32Array, LargeStringArray, RecordBatch,
    StringArray, StructArray,
};
use arrow_schema::{DataType, Field};

use super::tests::{drive, fixture};
use super::*;
use crate::testutil::{read_parts, write_parquet};

/// Input file `k` of three rows (row_index 3k..3k+2): a null prompt at row 4, `note` as
/// string in file 0 and large_string in file 1, `cat` a dictionary, `tags` a list, `meta` a
/// struct.
fn input_file(path: &std::path::Path, k: i64) {
    let rows: Vec<i64> = (3 * k..3 * k + 3).collect();
    let prompts: Vec<Option<&str>> = rows.iter().map(|&r| (r != 4).then_some("w5 w6")).collect();
    let notes: Vec<String> = rows.iter().map(|r| format!("note {r}")).collect();
    let note: ArrayRef = if k == 0 {
        Arc::new(StringArray::from(notes))
    } else {
        Arc::new(LargeStringArray::from(notes))
    };
    let cats: Vec<&str> = rows.iter().map(|r| ["a", "b"][*r as usize % 2]).collect();
    let cat: ArrayRef = Arc::new(cats.into_iter().collect::<DictionaryArray<Int8Type>>());
    let mut tags = ListBuilder::new(Int64Builder::new());
    for &r in &rows {
        tags.values().append_slice(&vec![r; r as usize % 3]);
        tags.append(true);
    }
    let meta = StructArray::from(vec![
        (
            Arc::new(Field::new("score", DataType::Float64, true)),
            Arc::new(Float64Array::from_iter_values(
                rows.iter().map(|&r| r as f64 / 2.0),
            )) as ArrayRef,
        ),
        (
            Arc::new(Field::new("rank", DataType::Int32, true)),
            Arc::new(Int32Array::from_iter_values(
                rows.iter().map(|&r| -(r as i32)),
            )),
        ),
    ]);
    let ids: Vec<String> = rows.iter().map(|r| format!("r{r}")).collect();
    let cols: Vec<(&str, ArrayRef)> = vec![
        ("prompt", Arc::new(StringArray::from(prompts))),
        ("id", Arc::new(StringArray::from(ids))),
        ("note", note),
        ("cat", cat),
        ("tags", Arc::new(tags.finish())),
        ("meta", Arc::new(meta)),
    ];
    write_parquet(path, cols, 2);
}

#[test]
fn kept_columns_ride_with_their_rows_in_their_types() {
    let mut f = fixture("kept", &[]);
    let files: Vec<_> = (0..2)
        .map(|k| f.dir.path().join(format!("in{k}.parquet")))
        .collect();
    for (k, path) in files.iter().enumerate() {
        input_file(path, k as i64);
    }
    f.cfg.input.input_files = files;
    f.cfg.output.keep_columns = ["meta", "note", "cat", "tags"].map(String::from).to_vec();
    (f.cfg.sampling.params.n, f.cfg.sampling.params.temperature) = (2, 1.0);
    let mut s = Run::new(f.cfg.clone()).unwrap();
    drive(&mut s, 1);
    s.finish().unwrap();
    let parts = read_parts(&f.cfg.output.output_dir);
    let schema = parts[0].schema();
    let tail: Vec<_> = schema.fields().iter().rev().take(4).rev().collect();
    let names: Vec<&str> = tail.iter().map(|f| f.name().as_str()).collect();
    assert_eq!(
        names,
        ["meta", "note", "cat", "tags"],
        "after the output's own, in order"
    );
    assert_eq!(
        tail[1].data_type(),
        &DataType::LargeUtf8,
        "string + large_string"
    );
    assert_eq!(
        tail[2].data_type(),
        &DataType::Utf8,
        "a dictionary by its values"
    );
    let mut seen = 0;
    for b in &parts {
        for i in 0..b.num_rows() {
            check_row(b, i);
            seen += 1;
        }
    }
    assert_eq!(
        seen, 12,
        "6 rows x 2 samples (the null prompt's error row both times)"
    );
}

/// Output row `i` of `b` holds its input row's kept values.
fn check_row(b: &RecordBatch, i: usize) {
    let r = b
        .column_by_name("row_index")
        .unwrap()
        .as_primitive::<Int64Type>()
        .value(i);
    let col = |n: &str| b.column_by_name(n).unwrap().clone();
    assert_eq!(col("note").as_string::<i64>().value(i), format!("note {r}"));
    assert_eq!(
        col("cat").as_string::<i32>().value(i),
        ["a", "b"][r as usize % 2]
    );
    let tags = col("tags").as_list::<i32>().value(i);
    assert_eq!(
        tags.as_primitive::<Int64Type>().values().to_vec(),
        vec![r; r as usize % 3]
    );
    let meta = col("meta");
    let meta = meta.as_struct();
    let score = meta
        .column(0)
        .as_primitive::<arrow_array::types::Float64Type>();
    assert_eq!(score.value(i), r as f64 / 2.0);
    assert_eq!(
        meta.column(1).as_primitive::<Int32Type>().value(i),
        -(r as i32)
    );
    let error = col("error");
    assert_eq!(
        error.is_valid(i),
        r == 4,
        "row {r}: only the null prompt is an error row"
    );
}

/// A kept column missing from a file, or of another kind than in an earlier file, is a user
/// error naming the key, the column and the file; so is one named as an output column.
#[test]
fn kept_columns_are_checked_before_any_work() {
    let mut f = fixture("kept-bad", &[Some("w5")]);
    f.cfg.output.keep_columns = vec!["note".into()];
    let err = Run::new(f.cfg.clone()).err().unwrap().to_string();
    assert!(
        err.contains("output.keep_columns") && err.contains("'note'"),
        "{err}"
    );
    f.cfg.output.keep_columns = vec!["output_text".into()];
    let err = Run::new(f.cfg.clone()).err().unwrap().to_string();
    assert!(err.contains("clashes with the output column"), "{err}");
    let text: ArrayRef = Arc::new(StringArray::from(vec!["w5"]));
    let (first, second) = (
        f.cfg.input.input_files[0].clone(),
        f.dir.path().join("in2.parquet"),
    );
    let x_text: ArrayRef = Arc::new(StringArray::from(vec!["a"]));
    let x_int: ArrayRef = Arc::new(arrow_array::Int64Array::from(vec![7]));
    write_parquet(&first, vec![("prompt", text.clone()), ("x", x_text)], 1);
    write_parquet(&second, vec![("prompt", text), ("x", x_int)], 1);
    f.cfg.input.input_files.push(second);
    (f.cfg.input.id_column, f.cfg.output.keep_columns) = (None, vec!["x".into()]);
    let err = Run::new(f.cfg.clone()).err().unwrap().to_string();
    assert!(
        err.contains("output.keep_columns: column 'x' has type"),
        "{err}"
    );
    assert!(err.contains("in2.parquet"), "{err}");
}

/// A kept column clashes only with a column this job's output has: the switches that add
/// optional columns (logprobs, a scoring task, ...) decide it, as they decide what is written.
#[test]
fn kept_columns_clash_only_with_the_columns_this_job_writes() {
    let mut f = fixture("kept-own", &[Some("w5")]);
    let has = |cfg: &RunConfig, name: &str| cfg.own_output_columns().iter().any(|c| c == name);
    for free in [
        "logprob",
        "logprobs",
        "n",
        "endpoint",
        "is_greedy",
        "reasoning_text",
    ] {
        assert!(!has(&f.cfg, free), "{free}");
    }
    assert!(has(&f.cfg, "output_text") && has(&f.cfg, "error"));
    f.cfg.sampling.params.logprobs = 2;
    assert!(has(&f.cfg, "logprobs"));
    f.cfg.output.keep_columns = vec!["logprobs".into()];
    let err = Run::new(f.cfg.clone()).err().unwrap().to_string();
    assert!(err.contains("column 'logprobs' clashes"), "{err}");
    (f.cfg.sampling.params.logprobs, f.cfg.task) = (0, "perplexity".into());
    assert!(has(&f.cfg, "logprob") && has(&f.cfg, "num_tokens") && !has(&f.cfg, "is_greedy"));
}
