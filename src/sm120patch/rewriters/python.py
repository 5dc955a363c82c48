"""libcst rewriters for Python sources: they match syntax, not text, and keep every byte of
formatting they do not need to touch."""

from __future__ import annotations

import ast
import functools
import textwrap

import libcst as cst

from sm120patch.errors import PatchDataError
from sm120patch.rewriters.base import AlreadyApplied, Changed, NoMatch, RewriteResult, Rewriter, decode, register
from sm120patch.words import counted

_EMPTY = cst.Module(body=[])

# libcst's trees are immutable, so one parse of a text serves every rewriter that reads those
# bytes: `manifest build` and `manifest add` run edits on the same release bytes once per
# combination of patches and per candidate set (parsing a large module takes ~0.1 s).
_parse_module = functools.lru_cache(maxsize=4)(cst.parse_module)


def _code(node: cst.CSTNode) -> str:
    """A node's source with whitespace collapsed, for comparing code by meaning."""
    return " ".join(_EMPTY.code_for_node(node).split())


class _SiteTransformer(cst.CSTTransformer):
    """Counts sites to patch and sites already patched, optionally within one function."""

    def __init__(self, function: str | None = None) -> None:
        super().__init__()
        self.function = function
        self._functions: list[str] = []
        self.found = 0
        self.applied = 0
        # Functions whose bodies cannot hold a site (they neither are nor enclose ``function``),
        # when known: visiting them is most of the work on a large module, so they are skipped.
        self.enclosing: set[str] | None = None

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._functions.append(node.name.value)
        return self.enclosing is None or self.in_scope or node.name.value in self.enclosing

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        self._functions.pop()
        return updated_node

    @property
    def in_scope(self) -> bool:
        return self.function is None or self.function in self._functions


def _enclosing(text: str, function: str) -> set[str] | None:
    """The names of the functions a ``def function`` is nested in (CPython's own parser, which
    is much faster than libcst's); None when it cannot say."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    names: set[str] = set()

    def walk(node: ast.AST, outer: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name == function:
                    names.update(outer)
                walk(child, (*outer, child.name))
            else:
                walk(child, outer)

    walk(tree, ())
    return names


class LibcstRewriter(Rewriter):
    """Parses, runs one :class:`_SiteTransformer` pass, and turns its counts into a result."""

    expression_params: tuple[str, ...] = ()
    statement_params: tuple[str, ...] = ()

    def validate(self) -> None:
        for key in self.expression_params:
            try:
                cst.parse_expression(self.args[key])
            except cst.ParserSyntaxError:
                raise PatchDataError(f"rewriter {self.name}: {key} is not a Python expression: {self.args[key]!r}") from None
        for key in self.statement_params:
            try:
                cst.parse_statement(self.args[key])
            except cst.ParserSyntaxError:
                raise PatchDataError(f"rewriter {self.name}: {key} is not a Python statement: {self.args[key]!r}") from None

    def transformer(self) -> _SiteTransformer:
        raise NotImplementedError

    def what(self) -> str:
        """The site, in words, for refusal messages."""
        raise NotImplementedError

    def rewrite(self, data: bytes, *, sites: int) -> RewriteResult:
        text = decode(data, self.name)
        if isinstance(text, NoMatch):
            return text
        try:
            module = _parse_module(text)
        except cst.ParserSyntaxError as exc:
            return NoMatch(f"file does not parse as Python ({exc.message}, line {exc.raw_line})")
        transformer = self.transformer()
        if transformer.function is not None:
            transformer.enclosing = _enclosing(text, transformer.function)
        new_module = module.visit(transformer)
        if transformer.found == 0 and transformer.applied == sites:
            return AlreadyApplied(sites)
        if transformer.found == sites and transformer.applied == 0:
            return Changed(new_module.code.encode("utf-8"), sites)
        return NoMatch(
            f"expected {counted(sites, 'site')} of {self.what()}, found {transformer.found} to patch"
            f" and {transformer.applied} already patched"
        )


@register
class ExtendListArgument(LibcstRewriter):
    """``f(keyword=[9, 10])`` inside ``function`` becomes ``f(keyword=[9, 10, value])``."""

    name = "python.extend-list-argument"
    description = "Append a value to a list literal passed as a keyword argument inside one function."
    params = {"function": str, "keyword": str, "value": str}
    expression_params = ("value",)

    def what(self) -> str:
        return f"{self.args['keyword']}=[...] in {self.args['function']}()"

    def transformer(self) -> _SiteTransformer:
        keyword = self.args["keyword"]
        value = cst.parse_expression(self.args["value"])
        value_code = _code(value)

        class Transformer(_SiteTransformer):
            def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
                if not (self.in_scope and updated_node.keyword and updated_node.keyword.value == keyword):
                    return updated_node
                if not isinstance(updated_node.value, cst.List):
                    return updated_node
                elements = updated_node.value.elements
                if any(_code(element.value) == value_code for element in elements):
                    self.applied += 1
                    return updated_node
                self.found += 1
                new_list = updated_node.value.with_changes(elements=[*elements, cst.Element(value=value)])
                return updated_node.with_changes(value=new_list)

        return Transformer(self.args["function"])


@register
class AddImportName(LibcstRewriter):
    """``from module import (a, after, b)`` becomes ``from module import (a, after, name, b)``."""

    name = "python.add-import-name"
    description = "Add a name to an existing 'from MODULE import ...' statement, right after a given name."
    params = {"module": str, "name": str, "after": str}

    def what(self) -> str:
        return f"'from {self.args['module']} import ..., {self.args['after']}'"

    def transformer(self) -> _SiteTransformer:
        wanted_module, name, after = self.args["module"], self.args["name"], self.args["after"]

        class Transformer(_SiteTransformer):
            def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
                if updated_node.module is None or _code(updated_node.module) != wanted_module:
                    return updated_node
                if isinstance(updated_node.names, cst.ImportStar):
                    return updated_node
                names = list(updated_node.names)
                imported = [_code(alias.name) for alias in names]
                if name in imported:
                    self.applied += 1
                    return updated_node
                if after not in imported:
                    return updated_node
                self.found += 1
                new_alias = cst.ImportAlias(name=cst.Name(name))
                names = _insert_after(names, imported.index(after), new_alias)
                return updated_node.with_changes(names=names)

        return Transformer()


def _insert_after(items: list, index: int, new_item):
    """Insert ``new_item`` after ``items[index]`` in a comma-separated sequence (import names,
    dict entries), keeping the layout: the new item takes over the anchor's comma (and with it
    whatever comes before the closing bracket), and the anchor gets the separator the other
    items use (for a one-per-line layout, a line break and the indent)."""
    anchor = items[index]
    separators = [item.comma for item in items[:-1] if isinstance(item.comma, cst.Comma)]
    separator = separators[0] if separators else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    return [
        *items[:index],
        anchor.with_changes(comma=separator),
        new_item.with_changes(comma=anchor.comma),
        *items[index + 1 :],
    ]


def _assigns(node: cst.CSTNode, name: str) -> bool:
    """Whether the module-level statement ``node`` assigns ``name`` (plainly, annotated or augmented)."""
    if not isinstance(node, cst.SimpleStatementLine):
        return False
    for small in node.body:
        targets = ([t.target for t in small.targets] if isinstance(small, cst.Assign)
                   else [small.target] if isinstance(small, (cst.AnnAssign, cst.AugAssign)) else [])
        if any(isinstance(t, cst.Name) and t.value == name for t in targets):
            return True
    return False


@register
class InsertStatementAfter(LibcstRewriter):
    """After the module-level assignment to ``anchor``, insert the statement ``statement``."""

    name = "python.insert-statement-after"
    description = "Insert one module-level statement right after the assignment to a given name."
    params = {"anchor": str, "statement": str}
    statement_params = ("statement",)

    def what(self) -> str:
        return f"the module-level assignment to {self.args['anchor']}"

    def transformer(self) -> _SiteTransformer:
        anchor = self.args["anchor"]
        statement = cst.parse_statement(self.args["statement"])
        statement_code = _code(statement)

        class Transformer(_SiteTransformer):
            def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
                body = list(updated_node.body)
                if any(_code(node) == statement_code for node in body):
                    self.applied += 1
                    return updated_node
                positions = [i for i, node in enumerate(body) if _assigns(node, anchor)]
                self.found += len(positions)
                for i in reversed(positions):
                    body.insert(i + 1, statement)
                return updated_node.with_changes(body=body)

        return Transformer()


@register
class ExtendOrCondition(LibcstRewriter):
    """A whole ``a or b`` chain inside ``function`` (all of ``operands``, in order) becomes
    ``a or b or add``; parentheses around the chain stay around the longer chain."""

    name = "python.extend-or-condition"
    description = "Add an alternative to an exact 'a or b' condition inside one function."
    params = {"function": str, "operands": list, "add": str}
    expression_params = ("add",)

    def validate(self) -> None:
        super().validate()
        if not self.args["operands"]:
            raise PatchDataError(f"rewriter {self.name}: operands must not be empty")
        for operand in self.args["operands"]:
            try:
                cst.parse_expression(operand)
            except cst.ParserSyntaxError:
                raise PatchDataError(f"rewriter {self.name}: operand is not a Python expression: {operand!r}") from None

    def what(self) -> str:
        return f"'{' or '.join(self.args['operands'])}' in {self.args['function']}()"

    def transformer(self) -> _SiteTransformer:
        operands = [_code(cst.parse_expression(o)) for o in self.args["operands"]]
        add = cst.parse_expression(self.args["add"])
        patched = [*operands, _code(add)]

        def is_or(node: cst.CSTNode) -> bool:
            return isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.Or)

        def chain(node: cst.BaseExpression) -> list[cst.BaseExpression]:
            # `a or b or c` parses left-associative: ((a or b) or c); an unparenthesised
            # left `or` belongs to the same chain.
            if is_or(node) and not node.lpar:
                return [*chain(node.left), *chain(node.right)]
            return [node]

        class Transformer(_SiteTransformer):
            def __init__(self, function: str) -> None:
                super().__init__(function)
                self._inner: set[int] = set()

            def visit_BooleanOperation(self, node: cst.BooleanOperation) -> None:
                # Only whole chains count: mark the left-nested parts of this chain.
                if is_or(node):
                    left = node.left
                    while is_or(left) and not left.lpar:
                        self._inner.add(id(left))
                        left = left.left

            def leave_BooleanOperation(
                self, original_node: cst.BooleanOperation, updated_node: cst.BooleanOperation
            ) -> cst.BaseExpression:
                if not self.in_scope or not is_or(original_node) or id(original_node) in self._inner:
                    return updated_node
                codes = [_code(part) for part in chain(original_node.with_changes(lpar=[], rpar=[]))]
                if codes == patched:
                    self.applied += 1
                elif codes == operands:
                    self.found += 1
                    return cst.BooleanOperation(
                        left=updated_node.with_changes(lpar=[], rpar=[]),
                        operator=cst.Or(),
                        right=add,
                        lpar=updated_node.lpar,
                        rpar=updated_node.rpar,
                    )
                return updated_node

        return Transformer(self.args["function"])


class _TableTransformer(_SiteTransformer):
    """Hands the elements of the module-level dict literal assigned to ``variable`` to :meth:`edit`
    (annotated or not: vLLM annotates its tables, `FI_ALLREDUCE_FUSION_MAX_SIZE_MB: dict[int,
    dict[int, float]] = {...}`), which returns the new elements, or None to leave it as it is."""

    def __init__(self, variable: str) -> None:
        super().__init__()
        self.variable = variable

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign) -> cst.Assign:
        return self._table(updated_node, [t.target for t in updated_node.targets])

    def leave_AnnAssign(self, original_node: cst.AnnAssign, updated_node: cst.AnnAssign) -> cst.AnnAssign:
        return self._table(updated_node, [updated_node.target])

    def _table(self, node, targets):
        if not any(isinstance(t, cst.Name) and t.value == self.variable for t in targets) or not isinstance(node.value, cst.Dict):
            return node
        elements = self.edit(list(node.value.elements))
        return node if elements is None else node.with_changes(value=node.value.with_changes(elements=elements))

    def edit(self, elements: list) -> list | None:
        raise NotImplementedError


@register
class CopyDictEntry(LibcstRewriter):
    """In the module-level dict literal assigned to ``variable``, the entry ``source_key``
    is duplicated right after itself under ``new_key`` (same value, same layout)."""

    name = "python.copy-dict-entry"
    description = "Duplicate one entry of a module-level dict literal under a new key."
    params = {"variable": str, "source_key": str, "new_key": str}
    expression_params = ("source_key", "new_key")

    def what(self) -> str:
        return f"key {self.args['source_key']} of the dict {self.args['variable']}"

    def transformer(self) -> _SiteTransformer:
        variable = self.args["variable"]
        source_key = _code(cst.parse_expression(self.args["source_key"]))
        new_key = cst.parse_expression(self.args["new_key"])
        new_key_code = _code(new_key)

        class Transformer(_TableTransformer):
            def edit(self, elements: list) -> list | None:
                keys = [_code(e.key) if isinstance(e, cst.DictElement) else None for e in elements]
                if new_key_code in keys:
                    self.applied += 1
                    return None
                if source_key not in keys:
                    return None
                self.found += 1
                index = keys.index(source_key)
                return _insert_after(elements, index, elements[index].with_changes(key=new_key))

        return Transformer(variable)


@register
class WidenAndOperand(LibcstRewriter):
    """In ``operand and x and ...`` inside ``function``, the leading ``operand`` becomes
    ``(operand or add)`` (older releases gate on one architecture flag alone)."""

    name = "python.widen-and-operand"
    description = "Turn the leading operand of an 'a and b ...' condition into '(a or NEW)' inside one function."
    params = {"function": str, "operand": str, "add": str}
    expression_params = ("operand", "add")

    def what(self) -> str:
        return f"'{self.args['operand']} and ...' in {self.args['function']}()"

    def transformer(self) -> _SiteTransformer:
        operand = cst.parse_expression(self.args["operand"])
        add = cst.parse_expression(self.args["add"])
        operand_code, widened_code = _code(operand), _code(cst.parse_expression(f"({self.args['operand']} or {self.args['add']})"))

        class Transformer(_SiteTransformer):
            def leave_BooleanOperation(
                self, original_node: cst.BooleanOperation, updated_node: cst.BooleanOperation
            ) -> cst.BaseExpression:
                if not self.in_scope or not isinstance(updated_node.operator, cst.And):
                    return updated_node
                left = _code(updated_node.left)
                if left == widened_code:
                    self.applied += 1
                elif left == operand_code:
                    self.found += 1
                    widened = cst.BooleanOperation(
                        left=updated_node.left, operator=cst.Or(), right=add,
                        lpar=[cst.LeftParen()], rpar=[cst.RightParen()],
                    )
                    return updated_node.with_changes(left=widened)
                return updated_node

        return Transformer(self.args["function"])


def _statements(source: str) -> list[cst.BaseStatement]:
    """The statements of ``source``; comments above the first one (libcst files them under the
    module's header) stay with it."""
    module = cst.parse_module(source)
    body = list(module.body)
    if body and module.header and hasattr(body[0], "leading_lines"):
        body[0] = body[0].with_changes(leading_lines=(*module.header, *body[0].leading_lines))
    return body


def _bare(statement: cst.CSTNode) -> str:
    """A statement by meaning: its syntax tree (``ast``), so neither layout, quotes nor comments
    count."""
    if hasattr(statement, "leading_lines"):
        statement = statement.with_changes(leading_lines=())
    return ast.dump(ast.parse(textwrap.dedent(_EMPTY.code_for_node(statement))))


@register
class ReplaceStatements(LibcstRewriter):
    """Inside ``function``, every run of consecutive statements equal by meaning to ``old``
    (one or more statements; comments do not count) becomes ``new``; the blank lines above the
    run stay, and so do its comments unless ``new`` brings its own. For backports of
    an upstream change that restructures a block (a check moved under an ``if``), where no
    smaller edit says the same thing."""

    name = "python.replace-statements"
    description = "Replace a run of statements, matched by meaning inside one function, by the given ones."
    params = {"function": str, "old": str, "new": str}

    def validate(self) -> None:
        for key in ("old", "new"):
            try:
                if not _statements(self.args[key]):
                    raise PatchDataError(f"rewriter {self.name}: {key} holds no statement")
            except cst.ParserSyntaxError:
                raise PatchDataError(f"rewriter {self.name}: {key} is not Python statements") from None

    def what(self) -> str:
        first = next(line for line in self.args["old"].splitlines() if line.strip() and not line.lstrip().startswith("#"))
        return f"the statements starting '{first}' in {self.args['function']}()"

    def transformer(self) -> _SiteTransformer:
        old = [_bare(s) for s in _statements(self.args["old"])]
        new_statements = _statements(self.args["new"])
        new = [_bare(s) for s in new_statements]

        def runs(body: list, wanted: list[str]) -> list[int]:
            codes = [_bare(s) for s in body]
            return [i for i in range(len(body) - len(wanted) + 1) if codes[i:i + len(wanted)] == wanted]

        class Transformer(_SiteTransformer):
            # The old statements reappear inside the new ones (a check moved under an ``if``): a
            # run inside an already-replaced run is part of it, not a site.
            def __init__(self, function: str) -> None:
                super().__init__(function)
                self._ancestors: list[cst.CSTNode] = []
                self._replaced: set[int] = set()

            def on_visit(self, node: cst.CSTNode) -> bool:
                self._ancestors.append(node)
                if isinstance(node, cst.IndentedBlock) and self.in_scope:
                    starts = runs(list(node.body), new)
                    self.applied += len(starts)
                    self._replaced.update(id(s) for i in starts for s in node.body[i:i + len(new)])
                return super().on_visit(node)

            def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode):
                self._ancestors.pop()
                return super().on_leave(original_node, updated_node)

            def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock):
                if not self.in_scope or any(id(node) in self._replaced for node in self._ancestors):
                    return updated_node
                body = list(updated_node.body)
                starts = runs(body, old)
                self.found += len(starts)
                for start in reversed(starts):
                    first = new_statements[0]
                    if hasattr(body[start], "leading_lines") and hasattr(first, "leading_lines"):
                        # The blank lines above the run stay; its comments give way to the new
                        # text's own, when it has some (they describe the old code).
                        kept = body[start].leading_lines
                        if first.leading_lines:
                            kept = tuple(line for line in kept if line.comment is None) + tuple(first.leading_lines)
                        first = first.with_changes(leading_lines=kept)
                    body[start:start + len(old)] = [first, *new_statements[1:]]
                return updated_node.with_changes(body=body)

        return Transformer(self.args["function"])


@register
class ReplaceExpression(LibcstRewriter):
    """Inside ``function`` (a method's name will do), every expression equal by meaning to ``old``
    becomes ``new``. ``new`` may hold ``old`` itself (a limit passed through a function): an
    expression equal to ``new`` is an applied site, and what is inside it is not looked at."""

    name = "python.replace-expression"
    description = "Replace an expression, matched by meaning inside one function, by another (which may wrap it)."
    params = {"function": str, "old": str, "new": str}
    expression_params = ("old", "new")

    def what(self) -> str:
        return f"'{self.args['old']}' in {self.args['function']}()"

    def transformer(self) -> _SiteTransformer:
        old = _code(cst.parse_expression(self.args["old"]))
        new_node = cst.parse_expression(self.args["new"])
        new = _code(new_node)

        class Transformer(_SiteTransformer):
            def on_visit(self, node: cst.CSTNode) -> bool:
                if isinstance(node, cst.BaseExpression) and self.in_scope and _code(node) == new:
                    self.applied += 1
                    return False
                return super().on_visit(node)

            def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode):
                result = super().on_leave(original_node, updated_node)
                if (isinstance(original_node, cst.BaseExpression) and self.in_scope
                        and _code(original_node) == old):
                    self.found += 1
                    return new_node
                return result

        return Transformer(self.args["function"])


@register
class ReplaceArgument(LibcstRewriter):
    """Inside ``function``, in each call to one of ``calls`` (dotted names as written:
    ``_flashinfer_comm.allreduce_fusion``, ``dict``), the keyword argument ``keyword=old``
    becomes ``keyword=new``."""

    name = "python.replace-argument"
    description = "Replace one keyword argument's value in the calls to given functions inside one function."
    params = {"function": str, "calls": list, "keyword": str, "old": str, "new": str}
    expression_params = ("old", "new")

    def what(self) -> str:
        return f"{self.args['keyword']}={self.args['old']} in a call to {' or '.join(self.args['calls'])} in {self.args['function']}()"

    def transformer(self) -> _SiteTransformer:
        calls, keyword = set(self.args["calls"]), self.args["keyword"]
        old = _code(cst.parse_expression(self.args["old"]))
        new_node = cst.parse_expression(self.args["new"])
        new = _code(new_node)

        class Transformer(_SiteTransformer):
            def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
                if not self.in_scope or _code(updated_node.func) not in calls:
                    return updated_node
                args = list(updated_node.args)
                for index, arg in enumerate(args):
                    if arg.keyword is None or arg.keyword.value != keyword:
                        continue
                    if _code(arg.value) == new:
                        self.applied += 1
                    elif _code(arg.value) == old:
                        self.found += 1
                        args[index] = arg.with_changes(value=new_node)
                return updated_node.with_changes(args=args)

        return Transformer(self.args["function"])


@register
class WrapDictEntry(LibcstRewriter):
    """In the module-level dict literal assigned to ``variable``, the value of the entry ``key``
    becomes ``wrap`` with its name ``VALUE`` standing for the value as it was
    (``_limits("fused", VALUE)``)."""

    name = "python.wrap-dict-entry"
    description = "Pass one entry's value of a module-level dict literal through an expression (VALUE: the value)."
    params = {"variable": str, "key": str, "wrap": str}
    expression_params = ("key", "wrap")

    def validate(self) -> None:
        super().validate()
        if "VALUE" not in self.args["wrap"]:
            raise PatchDataError(f"rewriter {self.name}: wrap must name VALUE, the entry's value: {self.args['wrap']!r}")

    def what(self) -> str:
        return f"key {self.args['key']} of the dict {self.args['variable']}"

    def transformer(self) -> _SiteTransformer:
        variable = self.args["variable"]
        key = _code(cst.parse_expression(self.args["key"]))
        wrap = cst.parse_expression(self.args["wrap"])

        def wrapped(value: cst.BaseExpression) -> cst.BaseExpression:
            class Fill(cst.CSTTransformer):
                def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
                    return value if updated_node.value == "VALUE" else updated_node

            return wrap.visit(Fill())

        class Transformer(_TableTransformer):
            def edit(self, elements: list) -> list:
                for index, element in enumerate(elements):
                    if not isinstance(element, cst.DictElement) or _code(element.key) != key:
                        continue
                    # Applied: the value already has the wrap's shape around some value.
                    if isinstance(element.value, cst.Call) and _code(element.value.func) == _code(getattr(wrap, "func", wrap)):
                        self.applied += 1
                    else:
                        self.found += 1
                        elements[index] = element.with_changes(value=wrapped(element.value))
                return elements

        return Transformer(variable)


@register
class InsertModuleCode(LibcstRewriter):
    """Before the module-level statement that binds ``before`` (an assignment, a ``def`` or a
    ``class``), insert the module-level code sm120patch ships under the name ``source``
    (``tuned-limits``: ``sm120patch/_tuned_runtime.py``, the server side of tuned limits).
    Applied: the module already defines the code's first function."""

    name = "python.insert-module-code"
    description = "Insert a block of module-level code that sm120patch ships, before the statement that binds a name."
    params = {"source": str, "before": str}
    SOURCES = {"tuned-limits": "_tuned_runtime.py"}

    def validate(self) -> None:
        if self.args["source"] not in self.SOURCES:
            raise PatchDataError(f"rewriter {self.name}: unknown source {self.args['source']!r} "
                                 f"(known: {', '.join(sorted(self.SOURCES))})")

    def what(self) -> str:
        return f"the module-level statement that binds {self.args['before']}"

    def code(self) -> cst.Module:
        from pathlib import Path

        text = (Path(__file__).resolve().parent.parent / self.SOURCES[self.args["source"]]).read_text(encoding="utf-8")
        return cst.parse_module(text)

    def transformer(self) -> _SiteTransformer:
        before = self.args["before"]
        code = self.code()
        first_def = next(s.name.value for s in code.body if isinstance(s, cst.FunctionDef))
        header = code.header  # the block's own comments (what it is, whose it is) open it

        def binds(node: cst.CSTNode) -> bool:
            if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
                return node.name.value == before
            return _assigns(node, before)

        class Transformer(_SiteTransformer):
            def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
                body = list(updated_node.body)
                if any(isinstance(node, cst.FunctionDef) and node.name.value == first_def for node in body):
                    self.applied += 1
                    return updated_node
                positions = [i for i, node in enumerate(body) if binds(node)]
                self.found += len(positions)
                for i in reversed(positions):
                    block = list(code.body)
                    # Two blank lines, the block's own comments, the block; the statement it goes
                    # before keeps its blank lines and comments.
                    block[0] = block[0].with_changes(
                        leading_lines=(cst.EmptyLine(), cst.EmptyLine(), *header, *block[0].leading_lines))
                    body[i:i] = block
                return updated_node.with_changes(body=body)

        return Transformer()
