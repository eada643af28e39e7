// Upload one file to POST /v1/files with progress; resolves to the file object, rejects with the server's message.

export function uploadFile(file, apiKey, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/v1/files");
    if (apiKey) xhr.setRequestHeader("Authorization", `Bearer ${apiKey}`);
    xhr.upload.onprogress = (ev) => { if (ev.lengthComputable) onProgress(ev.loaded / ev.total); };
    xhr.onload = () => {
      let body = null;
      try { body = JSON.parse(xhr.responseText); } catch { /* not JSON */ }
      if (xhr.status >= 200 && xhr.status < 300 && body && body.id) resolve(body);
      else reject(new Error(body?.error?.message || `upload failed (HTTP ${xhr.status})`));
    };
    xhr.onerror = () => reject(new Error("upload failed: the server could not be reached"));
    const form = new FormData();
    form.append("file", file, file.name || "pasted");
    form.append("purpose", "vision");
    xhr.send(form);
  });
}

// A thumbnail element for a local file: an <img>, or a <canvas> holding a video's poster frame.
export function thumbnail(file) {
  const url = URL.createObjectURL(file);
  if (!file.type.startsWith("video/")) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = file.name || "image";
    img.onerror = () => { img.hidden = true; };  // not an image this browser can show: no broken-image icon
    img.src = url;
    return img;
  }
  const canvas = document.createElement("canvas");
  canvas.className = "thumb video";
  canvas.width = 240;
  canvas.height = 180;
  canvas.setAttribute("aria-label", file.name || "video");
  const video = document.createElement("video");
  video.muted = true;
  video.preload = "auto";
  video.playsInline = true;
  video.onloadeddata = () => { video.currentTime = Math.min(0.1, (video.duration || 0) / 2); };
  video.onseeked = () => {
    canvas.width = video.videoWidth || 240;
    canvas.height = video.videoHeight || 180;
    canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
    canvas.dataset.poster = "ready";
    video.removeAttribute("src");
    video.load();
  };
  video.onerror = () => {  // a codec this browser lacks: a plain tile instead of a frame
    const g = canvas.getContext("2d");
    g.fillStyle = "#444";
    g.fillRect(0, 0, canvas.width, canvas.height);
    g.fillStyle = "#fff";
    g.font = "48px sans-serif";
    g.textAlign = "center";
    g.fillText("▶", canvas.width / 2, canvas.height / 2 + 16);
    canvas.dataset.poster = "unavailable";
  };
  video.src = url;
  return canvas;
}
