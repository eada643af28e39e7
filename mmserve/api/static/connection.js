// One WebSocket to /v1/chat/ws that reconnects by itself (backoff up to 4 s) and reports its state.

export class Connection {
  constructor({ apiKey, onEvent, onState }) {
    this.apiKey = apiKey;  // () => string
    this.onEvent = onEvent;
    this.onState = onState;  // (state, detail) with state: connecting | connected | reconnecting
    this.ws = null;
    this.delay = 250;
    this.timer = null;
    this.open();
  }

  url() {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const key = this.apiKey();
    const query = key ? `?api_key=${encodeURIComponent(key)}` : "";
    return `${proto}//${location.host}/v1/chat/ws${query}`;
  }

  open() {
    clearTimeout(this.timer);
    this.onState("connecting", "");
    const ws = new WebSocket(this.url());
    this.ws = ws;
    ws.onopen = () => { this.delay = 250; this.onState("connected", ""); };
    ws.onmessage = (msg) => {
      let event;
      try { event = JSON.parse(msg.data); } catch { return; }
      this.onEvent(event);
    };
    ws.onclose = (ev) => {
      if (this.ws !== ws) return;  // replaced by reconnect()
      this.ws = null;
      this.onEvent({ type: "connection.lost" });
      const secs = (this.delay / 1000).toFixed(1);
      const why = ev.code === 1008 ? "API key refused; " : "";
      this.onState("reconnecting", `${why}retrying in ${secs}s`);
      this.timer = setTimeout(() => this.open(), this.delay);
      this.delay = Math.min(this.delay * 2, 4000);
    };
  }

  get ready() { return this.ws !== null && this.ws.readyState === WebSocket.OPEN; }

  send(event) {
    if (!this.ready) return false;
    this.ws.send(JSON.stringify(event));
    return true;
  }

  // Drop the socket and open a new one now (e.g. after the API key changed).
  reconnect() {
    const old = this.ws;
    this.ws = null;
    if (old) old.close();
    this.delay = 250;
    this.open();
  }
}
