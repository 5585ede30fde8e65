//! Where in the file something was written, and the list of problems found while compiling, which
//! is only turned into [`Problem`]s (with the file name) at the end.

use std::fmt;

use crate::Problem;

/// A 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Mark {
    pub line: usize,
    pub col: usize,
}

impl fmt::Display for Mark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Problems(Vec<(Mark, String)>);

impl Problems {
    pub fn at(&mut self, mark: Mark, message: impl Into<String>) {
        self.0.push((mark, message.into()));
    }

    pub fn extend(&mut self, other: Problems) {
        self.0.extend(other.0);
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The problems in file order, each naming `file`.
    pub fn into_located(mut self, file: &str) -> Vec<Problem> {
        self.0.sort_by_key(|(mark, _)| *mark);
        self.0
            .into_iter()
            .map(|(mark, message)| Problem {
                file: file.to_owned(),
                line: mark.line,
                col: mark.col,
                message,
            })
            .collect()
    }

    #[cfg(test)]
    pub fn messages(&self) -> Vec<String> {
        self.0.iter().map(|(m, s)| format!("{m}: {s}")).collect()
    }
}
