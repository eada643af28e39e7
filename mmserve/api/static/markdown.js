// Light markdown -> DOM nodes: paragraphs, fenced code, lists, `code`, **bold**, *em*, [links](https://…).
// Every piece of text goes in through textContent / createTextNode: untrusted text is never parsed as HTML.

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(_[^_\s][^_\n]*_)|(\[[^\]\n]+\]\(https?:\/\/[^)\s]+\))/;

function el(tag, text) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  return node;
}

export function renderInline(text, parent) {
  let rest = text;
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) { parent.append(document.createTextNode(rest)); return; }
    if (m.index) parent.append(document.createTextNode(rest.slice(0, m.index)));
    const tok = m[0];
    if (m[1]) parent.append(el("code", tok.slice(1, -1)));
    else if (m[2]) parent.append(el("strong", tok.slice(2, -2)));
    else if (m[3] || m[4]) parent.append(el("em", tok.slice(1, -1)));
    else {
      const close = tok.indexOf("](");
      const a = el("a", tok.slice(1, close));
      a.href = tok.slice(close + 2, -1);  // only http(s) URLs match the pattern
      a.rel = "noopener noreferrer";
      a.target = "_blank";
      parent.append(a);
    }
    rest = rest.slice(m.index + tok.length);
  }
}

const LIST_ITEM = /^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/;

function renderBlock(text, parent) {
  const lines = text.split("\n");
  let para = [];
  let list = null;
  const flushPara = () => {
    if (para.length) { const p = el("p"); renderInline(para.join("\n"), p); parent.append(p); }
    para = [];
  };
  for (const line of lines) {
    const m = LIST_ITEM.exec(line);
    if (m) {
      flushPara();
      const ordered = m[1] !== undefined;
      if (!list || (list.tagName === "OL") !== ordered) {
        list = el(ordered ? "ol" : "ul");
        parent.append(list);
      }
      const li = el("li");
      renderInline(m[2], li);
      list.append(li);
    } else if (!line.trim()) {
      flushPara();
      list = null;
    } else {
      list = null;
      para.push(line);
    }
  }
  flushPara();
}

// Replaces parent's children with the rendering of `text` (an unclosed fence renders as code so far).
export function renderMarkdown(text, parent) {
  parent.replaceChildren();
  const parts = text.split(/^```[^\n]*\n?/m);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const pre = el("pre");
      pre.append(el("code", part.replace(/\n$/, "")));
      parent.append(pre);
    } else if (part) {
      renderBlock(part, parent);
    }
  });
}
